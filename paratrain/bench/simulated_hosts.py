"""`--simulate-hosts N` on the bench commands that start their own ranks: the option, its
one-line refusal and the words a header states it in, written once. What a world can play is
launch.check_simulated_hosts's rule; this module only says it as the command line's error."""

from __future__ import annotations

from collections.abc import Iterable

import click

from paratrain.launch import check_simulated_hosts


def simulate_hosts_option(help: str):
    """The option as every command declares it: no default, so that leaving it out reads as
    "this machine alone" (an IntRange(min=1) cannot default to 0)."""
    return click.option("--simulate-hosts", type=click.IntRange(min=1), default=None, metavar="N", help=help)


def checked_hosts(hosts: int | None, launcher: str, world_sizes: Iterable[int]) -> int:
    """The hosts to play (0: none asked for), after refusing in one line, before any rank
    starts, a launcher or any of the command's world sizes that cannot play them."""
    if not hosts:
        return 0
    sizes = list(world_sizes)
    if not sizes:
        raise click.BadParameter("no world of several ranks here to spread over hosts", param_hint="'--simulate-hosts'")
    try:
        for size in sizes:
            check_simulated_hosts(hosts, size, launcher)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="'--simulate-hosts'") from None
    return hosts


def hosts_words(hosts: int) -> str:
    """How a header says the hosts a run played: "" when it played none."""
    return f", on {hosts} simulated hosts" if hosts else ""
