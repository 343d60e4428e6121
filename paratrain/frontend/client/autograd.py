"""Whether operations issued now record autograd graphs on the workers (PyTorch's grad mode,
per thread, as in PyTorch)."""

from __future__ import annotations

import functools
import threading
import weakref

_state = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


class _GradMode:
    enabled: bool

    def __enter__(self):
        self._previous = is_grad_enabled()
        _state.enabled = self.enabled
        return self

    def __exit__(self, *exc):
        _state.enabled = self._previous
        return False

    def __call__(self, fn):  # also usable as a decorator, like torch.no_grad
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)
        return wrapped


class no_grad(_GradMode):  # noqa: N801 - PyTorch's (and GT's) name
    enabled = False


class enable_grad(_GradMode):  # noqa: N801
    enabled = True


class Node:
    """A tensor's place in the client's copy of the autograd graph: the nodes of the inputs it
    was computed from (none for a leaf). A node holds its tensor weakly and its inputs' nodes,
    not their tensors, so a result the program drops is freed on the workers at once (their
    graph keeps what backward needs), while the walk from a loss still reaches every leaf."""

    __slots__ = ("inputs", "tensor")

    def __init__(self, tensor, inputs: tuple = ()):
        self.inputs, self.tensor = inputs, weakref.ref(tensor)


SPENT = (None,)  # the inputs of a result whose graph backward has consumed (it stays a non-leaf)


def graph_of(root: Node) -> tuple[list, list, list]:
    """What `root`'s graph reaches: the leaf tensors that require grad, the result tensors still
    alive (root first), and every result node (to mark the graph spent)."""
    leaves, results, nodes, stack, seen = [], [], [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        tensor = node.tensor()
        if not node.inputs:
            if tensor is not None and tensor.requires_grad:
                leaves.append(tensor)
        elif node.inputs is not SPENT:
            nodes.append(node)
            stack.extend(node.inputs)
            if tensor is not None:
                results.append(tensor)
    return leaves, results, nodes


def run_backward(root, args: list, kwargs: dict, keep_graph: bool) -> None:
    """Issue `root`'s backward; afterwards every tensor its graph reaches has a gradient: the
    leaves, and the results still alive, which keep theirs because GT's do (PyTorch keeps only
    those marked with `retain_grad()`)."""
    leaves, results, nodes = graph_of(root._graph_node())
    if results:
        root._session.issue("keep_grads", [], [t._handle for t in results], [], tensors=tuple(results))
    root._session.issue("backward", [], args, list(range(len(args))), kwargs, tensors=(root,))
    for tensor in leaves + results:
        tensor._has_grad = True
        tensor._grad_tensor = None  # a new backward may have made a new tensor: ask again
    if not keep_graph:
        for node in nodes:
            node.inputs = SPENT
