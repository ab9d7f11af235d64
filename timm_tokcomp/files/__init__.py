"""Files in and out: user files read as data (userfiles: torch files with weights_only, safetensors headers), image
folders (data), run folders and atomic writes (outputs), content identities for --resume (identity), the Hub
(hub)."""
