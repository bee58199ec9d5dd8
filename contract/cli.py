"""How a command-line entry point reports a user's error: one line on stderr naming the field
(or the file) and the value, exit status 2 -- never a traceback. A bug is not a user's error and
keeps its traceback.

    if __name__ == "__main__":
        raise SystemExit(run_cli("python -m graph", main))
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Sequence

from contract.errors import RolloutError

USER_ERROR_STATUS = 2
# a missing / unreadable file the user named (the typed errors name their own field)
FILE_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
               PermissionError)


def _yaml_errors() -> tuple[type[BaseException], ...]:
    try:
        import yaml
    except ImportError:          # pragma: no cover - pyyaml is a dependency
        return ()
    return (yaml.YAMLError,)


def _pydantic_errors() -> tuple[type[BaseException], ...]:
    from pydantic import ValidationError
    return (ValidationError,)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are the user's input, not the program's bug."""
    return (RolloutError, *FILE_ERRORS, json.JSONDecodeError, *_yaml_errors(),
            *_pydantic_errors())


def error_line(exc: BaseException) -> str:
    """`Type: message; field=...; actual=...` on one line."""
    kind = type(exc).__name__
    if isinstance(exc, RolloutError):
        text = str(exc)
    elif isinstance(exc, FILE_ERRORS):
        text = f"{exc.strerror or 'cannot open'}; field=file; actual={exc.filename!r}"
    elif isinstance(exc, json.JSONDecodeError):
        text = f"not JSON: {exc.msg}; field=file; actual='line {exc.lineno} column {exc.colno}'"
    elif isinstance(exc, _pydantic_errors()):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        actual = first.get("input")
        if isinstance(actual, (dict, list, tuple)):
            actual = type(actual).__name__
        text = f"{first['msg']}; field={where}; actual={actual!r}"
    else:                                                  # a YAML error
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark is not None else "?"
        text = f"not valid YAML: {problem}; field=file; actual={where!r}"
    return " ".join(f"{kind}: {text}".split())


def run_cli(prog: str, main: Callable[[Sequence[str] | None], Any],
            argv: Sequence[str] | None = None) -> int:
    """main(argv)'s exit status (an int it returns, else 0); a user's error is one line on
    stderr and status 2."""
    try:
        status = main(argv)
        return status if isinstance(status, int) else 0
    except user_errors() as exc:
        print(f"{prog}: {error_line(exc)}", file=sys.stderr)
        return USER_ERROR_STATUS
