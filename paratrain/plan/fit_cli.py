"""`paratrain model fit`: a hardware profile from this machine's measurements."""

from __future__ import annotations

import os
import platform
from dataclasses import replace
from datetime import date
from pathlib import Path

import click

from paratrain.cli_types import OutputPath
from paratrain.plan.activations import Software
from paratrain.plan.calibrate import SHAPES, profile_compute
from paratrain.plan.fit import chosen_fits, fit_records, load_records, profile_yaml
from paratrain.plan.hardware import Compute, HardwareProfile, Link, load_profile

# paratrain as `paratrain train` runs it on a CPU: fp32, SDPA's flash kernel, no dropout, the
# sequence-parallel norm outputs kept gathered, layers cut by cost, whole activations sent.
PARATRAIN_CPU = Software(precision="fp32", flash_attention=True, dropout=False, sp_keeps_gathered=True,
                         even_layers=False, p2p_scatter_gather=False)
_SOFTWARE_NOTE = "paratrain on a CPU (see plan/fit_cli.py PARATRAIN_CPU)"


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)


def local_base(name: str) -> tuple[HardwareProfile, dict[str, str]]:
    """This host as a profile before anything is fitted, and where each value comes from."""
    cores = os.cpu_count() or 1
    link = Link(bandwidth_gbps=1.0, efficiency=1.0, latency_us=100.0)
    profile = HardwareProfile(
        name=name, description=f"{platform.processor() or platform.machine()} host, {cores} cores: "
                               "paratrain ranks as processes (gloo), one thread each",
        devices_per_node=1024, device_memory_gib=round(_memory_gib(), 1), reserved_gib=0.3,
        compute=Compute(1e-3, 1.0, 1.0, 1.0, 1.0, 0.0), intra_node=link, inter_node=link,
        software=PARATRAIN_CPU, cores=cores, dp_overlap=0.0)
    comments = {
        "name": "given to paratrain model fit", "description": "this host",
        "devices_per_node": "one host: every rank is local",
        "device_memory_gib": "this host's RAM (os.sysconf), shared by all its ranks",
        "reserved_gib": "assumption: a rank's Python, torch and gloo before any model",
        "cores": "os.cpu_count(): ranks beyond this share cores",
        "dp_overlap": "assumption: gloo's all-reduce needs the same cores backward runs on",
    }
    comments.update({f"software.{key}": _SOFTWARE_NOTE for key in vars(PARATRAIN_CPU)})
    return profile, comments


@click.group()
def model() -> None:
    """The performance model: fit it to measurements."""


@model.command()
@click.argument("results", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--base", help="Start from this profile (name or YAML) instead of this host's defaults.")
@click.option("--compute/--no-compute", default=True, show_default=True,
              help=f"Profile compute here: forward + backward of {len(SHAPES)} GPT block shapes (a few seconds).")
@click.option("--name", default="local", show_default=True, help="The profile's name.")
@click.option("-o", "--output", type=OutputPath(path_type=Path), default="profile.yaml",
              show_default=True, help="Where to write the profile.")
def fit(results, base, compute, name, output):
    """Fit alpha/beta per op, world size and algorithm from bench collectives / bench p2p JSON,
    and compute rates per op class from a short local profile; write a hardware profile.

    \b
    Examples:
      paratrain bench collectives --ops all_reduce,all_gather,reduce_scatter --algos auto,native --json c2.json
      paratrain bench p2p --json p2p.json
      paratrain model fit c2.json p2p.json -o my-host.yaml
      paratrain plan --model gpt-small --hardware my-host.yaml --tp 2
    """
    if base:
        try:
            profile, comments = replace(load_profile(base), name=name), {}
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="'--base'") from None
    else:
        profile, comments = local_base(name)
    try:
        fits = fit_records(load_records(list(results)))
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    chosen = chosen_fits(fits)
    click.echo(f"# {'op/world':<18} {'algo':<8} {'over':<10} {'alpha us':>9} {'GB/s':>9} {'sizes':>6} {'rms err':>8}")
    for fit_ in fits:
        launcher, world, op, algo = fit_.key
        mark = "*" if chosen.get(f"{op}/{world}") is fit_ else " "
        click.echo(f"{mark} {op + '/' + str(world):<18} {algo:<8} {launcher:<10} {fit_.fitted.alpha_us:>9.1f} "
                   f"{fit_.fitted.gbps:>9.3f} {fit_.points:>6} {fit_.rms_error:>8.0%}")
    collectives = {key: f.fitted for key, f in chosen.items()}
    profile = replace(profile, collectives={**profile.collectives, **collectives})
    p2p = chosen.get("p2p/2")
    if p2p:
        link = Link(bandwidth_gbps=p2p.fitted.gbps, efficiency=1.0, latency_us=p2p.fitted.alpha_us)
        profile = replace(profile, intra_node=link, inter_node=link)
        note = f"fitted to {p2p.source} (point-to-point, median over pairs)"
        comments.update({f"{section}.{key}": note for section in ("intra_node", "inter_node")
                         for key in ("bandwidth_gbps", "efficiency", "latency_us")})
    if compute:
        click.echo(f"# profiling compute: forward + backward of {len(SHAPES)} block shapes, one thread ...")
        fitted_compute, info = profile_compute(profile.software)
        profile = replace(profile, compute=fitted_compute)
        worst = max(info["relative_errors"].items(), key=lambda item: abs(item[1]))
        note = (f"fitted: fp32 blocks (forward + backward) beyond their matmuls and attention, {info['shapes']} "
                f"shapes; whole blocks then within {abs(worst[1]):.0%} ({worst[0]})")
        comments.update({"compute.memory_efficiency": note, "compute.op_overhead_us": note,
                         "compute.matmul_efficiency": "measured: the blocks' weight matmuls (forward, both "
                                                      "backward products) alone, one thread, CPU time",
                         "compute.attention_efficiency": "measured: causal SDPA forward + backward alone, "
                                                         "one thread, CPU time"})
        comments["compute.peak_tflops"] = "measured: best 1024^3 fp32 matmul on one thread (no data sheet on a CPU)"
        comments["compute.memory_gbps"] = "measured: dst.copy_(src) of 256 MiB (plan/membw.py)"
        click.echo(f"# compute: {fitted_compute}")
    header = [f"{name}: written by `paratrain model fit` on {date.today().isoformat()} from "
              f"{', '.join(p.name for p in results) or 'no result files'}"
              + (" and a local compute profile" if compute else "")]
    output.write_text(profile_yaml(profile, comments, header, fits, chosen))
    load_profile(output)  # what was written must read back
    click.echo(f"# wrote {output}")
