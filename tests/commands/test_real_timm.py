"""timm's families through every command at their smallest released configuration (tests/commands/real_configs.py):
ViT (vit_tiny: 3 heads of 64), EVA02 (rope, SwiGLU), NaFlexViT (base, NaFlex embedding, average pool: no class token for EViT), SAM (windows of 14, global
blocks, the neck; grid-keeping methods only)."""
import pytest

from real_configs import COMMANDS, RealConfig, check, run_command

SAM_REFUSES = "does not keep the patch tokens a complete grid"
CONFIGS = {
    "vit_tiny_patch16_224": RealConfig(("vit_tiny_patch16_224",)),
    "eva02_tiny_patch14_224": RealConfig(("eva02_tiny_patch14_224",)),
    "naflexvit_base_patch16_gap": RealConfig(("naflexvit_base_patch16_gap",), ("tome_r2", "tome_r4")),  # no class token
    "samvit_base_patch16_224": RealConfig(("samvit_base_patch16_224",), ("cubist_r2", "cubist_r1"),
                                          refused=(("calibrate", SAM_REFUSES),)),
}

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_command_serves_the_real_configuration(name, command, unlabelled_folder, tmp_path, capsys):
    config = CONFIGS[name]
    code, err = run_command(command, config, unlabelled_folder, tmp_path, capsys)
    check(command, config, code, err)
