"""The file loaders under damage (random, by hypothesis, and an image cut short): JSON, weights, labels files and
image folders load or name the file, never crash otherwise."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image
from safetensors.torch import save_file

from timm_tokcomp.files.data import open_dataset, open_images, read_labels
from timm_tokcomp.files.userfiles import UserFileError, read_json, read_safetensors, read_state_dict

pytestmark = [pytest.mark.slow]  # hypothesis through the readers


FILES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FILES
@given(st.binary(max_size=300))
def test_read_json_only_ever_returns_an_object_or_names_the_file(tmp_path, blob):
    path = tmp_path / "x.json"
    path.write_bytes(blob)
    try:
        assert isinstance(read_json(path, "--preset"), dict)
    except UserFileError as e:
        assert str(e).startswith(f"--preset {path}")


@FILES
@given(st.floats(0, 1, exclude_max=True), st.binary(max_size=64))
def test_weights_loaders_refuse_truncated_or_mangled_files(tmp_path, cut, tail):
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pth"):
        tensors = {"a": torch.arange(64.0), "b": torch.ones(3, 5)}
        save_file(tensors, str(path)) if path.suffix == ".safetensors" else torch.save(tensors, path)
        whole = path.read_bytes()
        damaged = whole[:int(cut * len(whole))] + tail
        path.write_bytes(damaged)
        try:
            state = read_state_dict(path, "--checkpoint")
        except UserFileError as e:
            assert str(e).startswith(f"--checkpoint {path}")
        else:  # whatever loads has the saved names and shapes (neither format has a checksum for the values)
            assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in tensors.items()}
        if path.suffix == ".safetensors":
            try:
                read_safetensors(path, "--tocom")
            except UserFileError as e:
                assert str(e).startswith(f"--tocom {path}")


@FILES
@given(st.text(max_size=200), st.sampled_from(["utf-8", "utf-16", "latin-1"]))
def test_labels_files_in_any_text_or_encoding_load_or_name_the_line(tmp_path, body, encoding):
    path = tmp_path / "labels.csv"
    try:
        path.write_bytes(("file,label\n" + body).encode(encoding))
    except UnicodeEncodeError:
        return
    try:
        rows = read_labels(path, "--data")
    except UserFileError as e:
        assert str(e).startswith(f"--data {path}")
    else:
        assert all(isinstance(label, int) and label >= 0 and name for name, label in rows)


@FILES
@given(st.floats(0, 1), st.sampled_from(["JPEG", "PNG"]))
def test_image_folders_refuse_files_cut_short_at_the_door_or_when_read(tmp_path, cut, fmt):
    folder = tmp_path / "imgs"
    folder.mkdir(exist_ok=True)
    path = folder / f"a.{fmt.lower()}"
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(path, format=fmt)
    whole = path.read_bytes()
    path.write_bytes(whole[:int(cut * len(whole))])
    try:
        dataset = open_dataset(_labelled(folder, path.name), lambda img: img)
        dataset[0]
    except UserFileError as e:
        assert str(e).startswith("--data ") and path.name in str(e)


def _labelled(folder, name):
    (folder / "labels.csv").write_text(f"file,label\n{name},0\n")
    return folder


def test_an_image_that_stops_decoding_is_named(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    pixels = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(folder / "img0.jpg")
    path = folder / "img0.jpg"
    path.write_bytes(path.read_bytes()[:-300])  # the header survives: the door's cheap check passes
    dataset = open_images(folder, lambda img: img)
    with pytest.raises(UserFileError, match="--data .*img0.jpg cannot be decoded"):
        [dataset[i] for i in range(len(dataset))]
