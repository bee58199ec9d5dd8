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
