"""graph.py builds nothing at import; `graph:app` (what `serve run graph:app` resolves) is the
embedded default graph, bound on first use."""
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_import_builds_nothing_and_app_is_bound_on_first_use():
    code = ("import graph\n"
            "assert graph._default_app is None, 'importing graph bound the default app'\n"
            "from ray.serve import Application\n"
            "from ray._common.utils import import_attr\n"
            "app = import_attr('graph:app')\n"
            "assert isinstance(app, Application), type(app)\n"
            "assert graph.app is app\n"
            "assert app._bound_deployment.name == 'RolloutGraph'\n"
            "try:\n"
            "    graph.no_such_name\n"
            "except AttributeError as err:\n"
            "    assert 'no_such_name' in str(err)\n"
            "else:\n"
            "    raise SystemExit('graph.no_such_name did not raise')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
