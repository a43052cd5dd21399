from runtime.demos.flowgrpo import main


def test_demo_reward_rises(capsys):
    assert main(iterations=12) is True
    out = capsys.readouterr().out
    assert "ROSE" in out and "clip_frac" in out
