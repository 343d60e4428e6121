"""The sweeps `make results` runs, each one `paratrain bench ...` command whose JSON becomes a
table of docs/results.md (results_page.py renders them). Small on purpose: representative of each
benchmark, not exhaustive."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sweep:
    name: str  # its JSON file is NAME.json in the results folder
    bench: str  # the `paratrain bench` subcommand, which also picks the table renderer
    title: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    plot: bool = False  # also --plot NAME.png (collectives only)


SWEEPS = (
    Sweep("collectives-2", "collectives", "Collectives on 2 processes: each algorithm against gloo's own",
          ("--nproc", "2", "--ops", "all_reduce,reduce_scatter,all_gather", "--algos",
           "ring,hd,oneshot,twoshot,native,auto", "--min-bytes", "16K", "--max-bytes", "16M", "--factor", "4",
           "--iters", "10"), plot=True),
    Sweep("collectives-mpi-2", "collectives", "Collectives on 2 processes beside MPICH's (mpi4py), rounds alternating",
          ("--peer", "mpi", "--nproc", "2", "--ops", "all_reduce,reduce_scatter,all_gather", "--min-bytes", "16K",
           "--max-bytes", "64M", "--factor", "4", "--iters", "20")),
    Sweep("collectives-mpi-4", "collectives", "Collectives on 4 processes (of 2 cores) beside MPICH's",
          ("--peer", "mpi", "--nproc", "4", "--ops", "all_reduce,reduce_scatter,all_gather", "--min-bytes", "16K",
           "--max-bytes", "64M", "--factor", "4", "--iters", "20")),
    Sweep("all-to-all-mpi-2", "collectives", "All-to-all in equal and uneven parts on 2 processes beside MPICH's "
          "(Alltoall, Alltoallv)", ("--peer", "mpi", "--nproc", "2", "--ops", "all_to_all", "--splits", "both",
                                    "--min-bytes", "16K", "--max-bytes", "16M", "--factor", "4", "--iters", "20")),
    Sweep("all-to-all-mpi-4", "collectives", "All-to-all in equal and uneven parts on 4 processes beside MPICH's",
          ("--peer", "mpi", "--nproc", "4", "--ops", "all_to_all", "--splits", "both", "--min-bytes", "16K",
           "--max-bytes", "16M", "--factor", "4", "--iters", "20")),
    Sweep("collectives-4", "collectives", "Every collective on 4 processes: the default pick (auto) against gloo's own",
          ("--nproc", "4", "--algos", "auto,native", "--min-bytes", "16K", "--max-bytes", "16M",
           "--factor", "4", "--iters", "10")),
    Sweep("collectives-hosts", "collectives", "Collectives on 4 processes playing 2 hosts (loopback between them): "
          "hier against the flat algorithms", ("--nproc", "4", "--simulate-hosts", "2", "--ops",
                                               "all_reduce,reduce_scatter,all_gather", "--algos", "ring,direct,hier,native",
                                               "--min-bytes", "64K", "--max-bytes", "16M", "--factor", "4", "--iters", "10")),
    Sweep("collectives-threads", "collectives", "All-reduce on 2 threads (the in-process fabric)",
          ("--launcher", "threads", "--nproc", "2", "--ops", "all_reduce", "--algos", "ring,hd,native",
           "--min-bytes", "64K", "--max-bytes", "64M", "--factor", "4", "--iters", "10")),
    Sweep("p2p-shm", "p2p", "Point-to-point between 2 processes, through shared memory (the default on one host)",
          ("--nproc", "2", "--min-bytes", "8", "--max-bytes", "16M", "--factor", "8", "--iters", "20")),
    Sweep("p2p-gloo", "p2p", "Point-to-point between 2 processes, through gloo's sockets",
          ("--nproc", "2", "--min-bytes", "8", "--max-bytes", "16M", "--factor", "8", "--iters", "20"),
          env=(("PARATRAIN_SHM", "0"),)),
    Sweep("ddp", "ddp", "Data parallelism on 2 processes: ours against PyTorch's DDP and ZeroRedundancyOptimizer",
          ("--nproc", "2", "--models", "mlp16,cnn-small", "--modes", "naive,ddp,torch-ddp,zero1,torch-zero1",
           "--repeats", "2", "--steps", "10")),
    Sweep("sharding-2", "ddp", "Sharded data parallelism on 2 processes: our DDP, ZeRO-1 and FSDP against PyTorch's FSDP2",
          ("--nproc", "2", "--models", "mlp16,gpt-small", "--modes", "ddp,zero1,fsdp,torch-fsdp",
           "--repeats", "2", "--steps", "10")),
    Sweep("scaling", "scaling", "Weak and strong scaling of data-parallel training, 1 and 2 processes",
          ("--model", "mlp", "--max-nproc", "2", "--steps", "10")),
    Sweep("pipeline", "pipeline", "Pipeline schedules on 2 processes: ours against torch.distributed.pipelining",
          ("--nproc", "2", "--steps", "10")),
    Sweep("tp", "tp", "Tensor parallelism: our GPT layers against PyTorch's DTensor tensor parallelism",
          ("--nprocs", "2,4", "--rounds", "3")),
    Sweep("frontend", "frontend", "The single-controller frontend (1 worker) against plain PyTorch",
          ("--repeats", "3",)),
    Sweep("cp", "cp", "Context-parallel attention: ring and all-gather, zigzag and contiguous, cp 1, 2 and 4",
          ("--cp", "1,2,4", "--seq", "1024,2048", "--steps", "3")),
    Sweep("moe-experts", "moe", "Routed experts' matmuls at moe-small's widths: one grouped_mm per weight against a "
          "per-expert loop, 8 and 64 experts", ("--experts", "8", "--experts", "64", "--d-model", "128",
                                                 "--d-expert", "96", "--repeats", "15")),
    Sweep("moe-experts-wide", "moe", "Routed experts' matmuls at wider experts (d_model 256, d_expert 512), where the "
          "matmuls themselves take most of the time", ("--experts", "8", "--experts", "64", "--repeats", "7")),
    Sweep("moe-ep", "moe", "Expert parallelism: moe-tiny trained on 4 processes at ep 1, 2 and 4, and the bytes it dispatches",
          ("--ep", "1,2,4", "--nproc", "4", "--steps", "10", "--rounds", "3")),
)
