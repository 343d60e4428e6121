"""How a `paratrain` command ends when something goes wrong: an error the user can fix is one
line (`paratrain train: error: WHAT`) and exit code 2 (a command's own click.ClickException
keeps its code: 1, a result such as a benchmark's wrong elements); a bug keeps its traceback.

What the user can fix: a UserError (paratrain/errors.py: bad values, checkpoints, records,
lost ranks), click's own usage errors (an unknown flag, a value of the wrong type), and an
OSError (a path that is missing or not writable, a port in use): that last is the machine's
answer to what the user asked for, never a wrong turn in our code. Everything else (a
TypeError, a KeyError, a RuntimeError from torch) escapes with its traceback, as Python prints
it: that is a bug to report. `--debug` on the command line or PARATRAIN_DEBUG=1 prints the
traceback of a user's error too, before its line.
"""

from __future__ import annotations

import errno
import sys
import traceback

import click

from paratrain.errors import Problems, UserError
from paratrain.environment import Settings

_BARE_GROUP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2: `paratrain bench` alone


class OneLineErrors:
    """Mixed into the click command a program starts from (`paratrain`, and the commands that
    `python -m paratrain.frontend.server|worker` start): its `main` reports errors as above.
    The commands under it are invoked, not started, so they report through it."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:  # the caller handles errors itself
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        args = list(sys.argv[1:] if args is None else args)
        prog_name = prog_name or "paratrain"
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except _BARE_GROUP as bare:
            bare.show()  # the group's help, as click shows it
            sys.exit(bare.exit_code)
        except (UserError, click.ClickException, OSError) as error:
            if isinstance(error, OSError) and error.errno == errno.EPIPE:
                sys.exit(1)  # the reader of our output went away (`| head`): nothing to say
            if debug_requested(args):
                traceback.print_exception(error)
            where = command_path(self, prog_name, args, error)
            for lines in error_lines(error):
                click.echo(f"{where}: error: {lines[0]}", err=True)
                for line in lines[1:]:
                    click.echo(f"  {line}", err=True)
            sys.exit(getattr(error, "exit_code", UserError.exit_code))  # an OSError has none
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


def debug_requested(args: list[str]) -> bool:
    options = args[:args.index("--")] if "--" in args else args
    return "--debug" in options or _debug_setting()


def _debug_setting() -> bool:
    try:
        return Settings.resolve().debug
    except ValueError:  # a bad setting: that is the error being reported
        return False


def error_lines(error: BaseException) -> list[list[str]]:
    """Per error (a configuration's problems are several), the line that says what went wrong
    and any lines that say where to look next."""
    if isinstance(error, Problems):
        return [[problem] for problem in error.problems]
    if isinstance(error, UserError):
        lines = error.lines()
    elif isinstance(error, click.ClickException):
        lines = [error.format_message()]
    elif error.filename is not None:  # an OSError about a path
        paths = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 is not None else "")
        lines = [f"{error.strerror or error}: {paths}"]
    else:
        lines = [str(error)]
    lines = [" ".join(line.split()) for line in lines]
    notes = " ".join(getattr(error, "__notes__", ()))  # where: "(raised on rank 1 of 2, launcher=threads)"
    if notes:
        lines[0] += " " + notes
    return [lines]


def command_path(top: click.Command, prog_name: str, args: list[str], error: BaseException) -> str:
    """`paratrain train`, `paratrain bench collectives`: the command that failed."""
    ctx = getattr(error, "ctx", None)  # click's usage errors know it
    if ctx is not None:
        return ctx.command_path
    words, command = [prog_name], top
    for arg in args:
        if arg.startswith("-"):
            continue  # an option of a group (paratrain --debug train ...)
        command = command.get_command(None, arg) if isinstance(command, click.Group) else None
        if command is None:
            break
        words.append(arg)
    return " ".join(words)


class OneLineCommand(OneLineErrors, click.Command):
    """A command also started on its own (`python -m paratrain.frontend.server`)."""
