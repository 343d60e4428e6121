"""Pipeline parallelism: the model cut into consecutive chunks across the ranks of the mesh's pp
axis, microbatches flowing through them.

`schedules` says who runs what in which order (pure data: GPipe, 1F1B, interleaved 1F1B, ZB-H1,
ZB-V); `simulate` plays a schedule forward in time to measure its bubble and memory; `timeline`
prints and draws it; `schedule_cli` is `paratrain schedule`. The runtime executes the same lists.
"""
