"""The error a user can cause and fix: a bad value, a missing or unwritable path, a corrupted
or mismatched checkpoint, a malformed record, a rank that was lost.

Raise a UserError (or a subclass) whose message says what is wrong and where, in one line: the
`paratrain` command prints it as one line and exits 2 (cli_errors.py). Anything else that
escapes a command is a bug in paratrain and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; str() is one line naming what and where."""

    exit_code = 2  # what click and argparse exit with for a usage error

    def lines(self) -> list[str]:
        """What the command prints: the line saying what went wrong, then any saying where to
        look next (a RanksFailed's flight records)."""
        return [str(self)]


class Problems(UserError):
    """Every problem found at once (in a configuration, say), one line each, so that a user
    fixes them in one go instead of one failed launch at a time."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def yaml_problem(path, error) -> str:
    """One line for a yaml.YAMLError: where in `path`, and what (PyYAML's own message spans
    several lines, quoting the file's name twice)."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(error, "problem", None) or str(error)
    return f"{path} is not valid YAML{where}: {' '.join(what.split())}"


class UnreadableYaml(UserError):
    """A YAML file that cannot be read: missing, not text, or not YAML (one line)."""


def read_yaml(path, what: str):
    """The data in the YAML file at `path` (`what` it is, for the message); UnreadableYaml
    with one line when it cannot be read, is not UTF-8 text, or is not YAML."""
    import yaml

    try:
        with open(path, encoding="utf-8") as stream:
            return yaml.safe_load(stream)
    except OSError as error:
        raise UnreadableYaml(f"cannot read {what} {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise UnreadableYaml(f"{what} {path} is not UTF-8 text (byte {error.start} is 0x{error.object[error.start]:02x})"
                             ) from None
    except yaml.YAMLError as error:
        raise UnreadableYaml(yaml_problem(path, error)) from None
