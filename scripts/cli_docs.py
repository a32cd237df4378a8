"""Regenerate docs/cli.md from the command line itself: `python scripts/cli_docs.py > docs/cli.md`.

tests/test_cli_basic.py fails when a command or flag is missing from docs/cli.md.
"""

from __future__ import annotations

import typer.main

from gradian.cli import app

HEADER = """# Command-line reference

`gradian COMMAND --help` prints the same. Most commands take `--config` / `-c`; a flag always wins
over the file.

`python -m gradian` runs the same command line.

On a terminal, tables are drawn with rich. When stdout is a pipe or a file they are printed as one
row per line, cells separated by tabs, never truncated (`gradian checks | grep config.`), and
`checks`, `diagnose` and `doctor` take `--json` for the same data as JSON. Library warnings,
advisories and download bars are kept out of the output; `gradian --verbose COMMAND` lets them
through.

## Exit codes

| code | meaning |
|---|---|
| 0 | done |
| 1 | a gate tripped: `diagnose --fail-on SEVERITY` (a finding at or above it fired), `plan --fail-if-over` |
| 2 | bad input: a missing file, a malformed line, an unknown config key, a bad flag value, an unknown run |
| 3 | the environment: a missing package, an unwritable folder, a tracking server that does not answer |
| 70 | an internal error (a bug): one line `error: internal error: <type>: <message> (rerun with --debug for the traceback)` |
| 130 | interrupted with Ctrl-C |
| 143 | stopped with SIGTERM (what `kill`, `timeout` and schedulers send) |

Codes 2, 3 and 70 print one line on stderr, `error: ...`, naming the file, line, key, flag or run
and the fix; `gradian --debug COMMAND` shows the full traceback instead. On Ctrl-C or SIGTERM the
cleanups run first: an MLflow run Gradian had opened is marked FAILED. One left RUNNING anyway
(SIGKILL, or the server gone when it was to be closed; the error names it) is marked FAILED, tagged
`gradian.stale=true` and named in a warning by the next Gradian run logged under the same training
run. A password or token in a URI (`http://user:pass@host`, `?token=...`) is printed as `***` in
every message.
"""


def _default(param: object) -> str:
    if param.default in (None, False) or (getattr(param, "is_flag", False) and not param.default):
        return ""
    return "empty" if param.default == "" else f"`{param.default}`"


def main() -> None:
    print(HEADER)
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        subs = command.commands.items() if hasattr(command, "commands") else [(None, command)]
        for subname, sub in subs:
            print(f"## `gradian {name}" + (f" {subname}" if subname else "") + "`\n")
            print((sub.help or "").strip().split("\n")[0] + "\n")
            rows = []
            for p in sub.params:
                if p.name == "help":
                    continue
                if type(p).__name__.endswith("Argument"):
                    rows.append((f"`{p.name.upper()}` (argument)", "", "required" if p.required else ""))
                else:
                    rows.append((", ".join(f"`{o}`" for o in p.opts), p.help or "", _default(p)))
            if rows:
                print("| flag | what it does | default |\n|---|---|---|")
                for flag, text, default in rows:
                    print(f"| {flag} | {text} | {default} |")
                print()


if __name__ == "__main__":
    main()
