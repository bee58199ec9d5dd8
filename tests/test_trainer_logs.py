"""A new run starts its metrics file empty; a resumed run appends (no mixing of two runs)."""
from trainer.logs import MetricsLogger, read_metrics


def test_fresh_run_truncates_and_resume_appends(tmp_path):
    first = MetricsLogger(tmp_path)
    first.log(0, {"reward": 0.1})
    first.log(1, {"reward": 0.2})
    first.close()
    resumed = MetricsLogger(tmp_path, fresh=False)
    resumed.log(2, {"reward": 0.3})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    again = MetricsLogger(tmp_path)
    again.log(0, {"reward": 0.5})
    again.close()
    assert read_metrics(tmp_path) == [{"step": 0, "reward": 0.5}]


def test_wandb_offline_run_gets_config_metrics_and_captioned_media(tmp_path):
    """W&B in offline mode writes a local run (no network); a resumed run keeps its id."""
    import time

    from PIL import Image

    from trainer.logs import WandbRun
    png = tmp_path / "grid.png"
    Image.new("RGB", (16, 8), (0, 200, 0)).save(png)
    run = WandbRun(tmp_path, "offline", "omni-test", None, {"nft": {"beta": 0.25}}, resume=False)
    logger = MetricsLogger(tmp_path, wandb=run)
    logger.log(1, {"reward_mean": 0.625, "note": "text is not a scalar"})
    run.log_media(1, images=[(png, "a red circle | total 0.625")])
    logger.close()
    [run_dir] = list((tmp_path / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wandb_id").read_text()
    [record] = list(run_dir.glob(f"run-{run_id}.wandb"))
    deadline = time.time() + 60            # wandb-core may still be writing on a loaded machine
    while b"reward_mean" not in record.read_bytes() and time.time() < deadline:
        time.sleep(0.5)
    data = record.read_bytes()
    for needle in (b"reward_mean", b"0.625", b"beta", b"0.25", b"a red circle | total 0.625"):
        assert needle in data, needle
    assert b"text is not a scalar" not in data
    assert list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert read_metrics(tmp_path)[0]["reward_mean"] == 0.625        # TensorBoard/jsonl too
    again = WandbRun(tmp_path, "offline", "omni-test", None, {}, resume=True)
    again.close()
    assert (tmp_path / "wandb_id").read_text() == run_id


def test_gallery_is_a_captioned_grid_of_step0_and_now():
    import torch

    from contract import RewardReport, RolloutOutput, ScorerOutput, ScoreStatus
    from trainer.gallery import captioned_grid, sample_captions
    report = RewardReport({"attr": ScorerOutput("attr", {"s": (0.5, 0.25)}, (ScoreStatus.OK,) * 2,
                                                (None, None))}, (0.5, 0.25), {"attr": 1.0},
                          {"attr": (0.5, None)})
    caps = sample_captions([RolloutOutput("r", {}, None, "v", (1, 2), rewards=report)])
    assert caps == ["total 0.500 | attr 0.500", "total 0.250 | attr missing"]
    before = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)             # 2 prompts x 2 samples
    after = torch.full((4, 3, 8, 8), 255, dtype=torch.uint8)
    after[:, 1:] = 0                                                   # red "now" samples
    grid = captioned_grid(["a red circle", "a blue square"], 2, (before, caps * 2),
                          (after, caps * 2), step=7, cell=32)
    px = grid.load()
    assert grid.width == 4 * (32 + 6) + 12
    row_y = [y for y in range(grid.height) if px[6 + 16, y] == (0, 0, 0)]     # step-0 column
    assert row_y, "the step-0 samples are drawn"
    red = [x for x in range(grid.width) if px[x, row_y[0]] == (255, 0, 0)]
    assert red and min(red) > 2 * (32 + 6)                             # now: the right half
