"""A parallelism plan, applied to any nn.Module from outside it (torchtitan's parallelize_module,
picotron's Llama): module paths -> tensor-parallel styles, and the model read as a list of blocks
for the pipeline. Our GPT and Llama carry theirs in models/plans.py; a user's model brings one as
a Python dict or a YAML file of the same keys:

    tensor_parallel:                     # module path pattern -> style ('*' is one path part)
      tok_emb: vocab_embed               # Embedding: vocabulary ranges, summed over ranks
      layers.*.attn.wq: colwise          # Linear: output features split ({style: colwise, parts: 3}
      layers.*.attn.wo: rowwise          #   for a fused [q | k | v]); rowwise: input features split
      output: vocab_head                 # Linear: logits left sharded for the vocab-parallel loss
      pos_emb: replicate                 # whole on every rank (an Embedding's output follows the
                                         #   sequence shards under sequence parallelism)
    head_counts:                         # attributes divided by tp, as the heads are split
      layers.*.attn: [n_heads, n_kv_heads]   # (or the module's own `head_count_attrs`; [] for a module
                                         #   that reads its heads from its input)
    sequence_parallel:                   # where activations sharded on the sequence are gathered
      gather_inputs: [layers.*.attn, layers.*.mlp, output]
      enabled: false                     # on for every run of this plan (or --sequence-parallel)
    pipeline:
      blocks: layers                     # the ModuleList of blocks, each x_BTD -> x_BTD
      before: [tok_emb]                  # run in order before the first block ...
      after: [norm, output]              # ... and after the last
      balance: cost                      # contiguous chunks balanced by cost (matmul parameters), by
                                         #   count (of blocks), or by measured forward+backward time
    context_parallel:                    # what context parallelism (--cp) needs of the model:
      attention: [layers.*.attn]         # modules whose F.scaled_dot_product_attention calls become
                                         #   attention over the whole sequence (ring or all-gather)
      positions: [layers.*.attn.positions]   # buffers indexed by position along dim 0 (an
                                         #   arange, a rotary table), read as buffer[:T]: each rank's
                                         #   holds its own tokens' rows

Every problem with a plan is a PlanError of one line that names the module (check_plan lists
them all before any rank starts). Applying tensor parallelism is parallel/tensor/parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from torch import nn

from paratrain.errors import UnreadableYaml, UserError, read_yaml
from paratrain.parallel.tensor.layers import linear_shape

STYLES = ("colwise", "rowwise", "vocab_embed", "vocab_head", "replicate")
BALANCES = ("cost", "count", "measured")
_KEYS = ("tensor_parallel", "head_counts", "sequence_parallel", "pipeline", "context_parallel")


class PlanError(UserError, ValueError):
    """A plan that cannot be applied; the message is one line naming the module or key."""


@dataclass(frozen=True)
class Style:
    name: str  # one of STYLES
    parts: int = 1  # colwise: blocks fused side by side in the output ([q | k | v]: 3)


@dataclass
class PipelinePlan:
    blocks: str  # path of the ModuleList of blocks
    before: list = field(default_factory=list)  # paths (or, in Python, callables model -> module)
    after: list = field(default_factory=list)
    balance: str = "cost"


@dataclass
class ContextPlan:
    attention: list[str]  # module path patterns whose scaled_dot_product_attention runs over cp
    positions: list[str] = field(default_factory=list)  # buffer path patterns, indexed by position


@dataclass
class Plan:
    tensor_parallel: dict[str, Style] = field(default_factory=dict)
    head_counts: dict[str, list[str]] = field(default_factory=dict)
    gather_inputs: list[str] = field(default_factory=list)
    sequence_parallel: bool = False  # the plan's default; a run may switch it on
    pipeline: PipelinePlan | None = None
    context: ContextPlan | None = None
    source: str = "plan"  # where it came from, for messages


def load_plan(source) -> Plan:
    """A Plan from a Plan, a dict, or a YAML file's path; PlanError for anything malformed."""
    if isinstance(source, Plan):
        return source
    name = "plan"
    if isinstance(source, (str, Path)):
        name = str(source)
        try:
            source = read_yaml(source, "plan")
        except UnreadableYaml as error:
            raise PlanError(str(error)) from None
    if not isinstance(source, dict):
        raise PlanError(f"{name}: a plan is a mapping with keys {', '.join(_KEYS)}")
    unknown = sorted(set(source) - set(_KEYS))
    if unknown:
        raise PlanError(f"{name}: unknown key {unknown[0]!r}; valid: {', '.join(_KEYS)}")
    plan = Plan(source=name)
    for pattern, style in _mapping(source, "tensor_parallel", name).items():
        plan.tensor_parallel[str(pattern)] = _style(style, pattern, name)
    for pattern, attrs in _mapping(source, "head_counts", name).items():
        attrs = [attrs] if isinstance(attrs, str) else attrs
        if not isinstance(attrs, list) or not all(isinstance(a, str) for a in attrs):
            raise PlanError(f"{name}: head_counts[{pattern!r}] must be a list of attribute names")
        plan.head_counts[str(pattern)] = attrs
    sp = _mapping(source, "sequence_parallel", name)
    _only_keys(sp, ("gather_inputs", "enabled"), f"{name}: sequence_parallel")
    if not isinstance(sp.get("enabled", False), bool) or not isinstance(sp.get("gather_inputs", []), list):
        raise PlanError(f"{name}: sequence_parallel.enabled is true or false; gather_inputs a list of module paths")
    plan.gather_inputs = [str(p) for p in sp.get("gather_inputs", [])]
    plan.sequence_parallel = sp.get("enabled", False)
    if source.get("pipeline") is not None:
        plan.pipeline = _pipeline(_mapping(source, "pipeline", name), name)
    if source.get("context_parallel") is not None:
        plan.context = _context(_mapping(source, "context_parallel", name), name)
    return plan


def _context(cp: dict, name: str) -> ContextPlan:
    _only_keys(cp, ("attention", "positions"), f"{name}: context_parallel")
    attention, positions = cp.get("attention"), cp.get("positions", [])
    for key, value in (("attention", attention), ("positions", positions)):
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise PlanError(f"{name}: context_parallel.{key} must be a list of module paths"
                            f"{' (at least one: the attention modules)' if key == 'attention' else ''}")
    if not attention:
        raise PlanError(f"{name}: context_parallel.attention must name the attention modules")
    return ContextPlan(list(attention), list(positions))


def _pipeline(pp: dict, name: str) -> PipelinePlan:
    _only_keys(pp, ("blocks", "before", "after", "balance"), f"{name}: pipeline")
    if not isinstance(pp.get("blocks"), str):
        raise PlanError(f"{name}: pipeline.blocks must name the module list of blocks, e.g. 'layers'")
    before, after = pp.get("before", []), pp.get("after", [])
    for key, value in (("before", before), ("after", after)):
        if not isinstance(value, list):
            raise PlanError(f"{name}: pipeline.{key} must be a list of module paths")
    if pp.get("balance", "cost") not in BALANCES:
        raise PlanError(f"{name}: pipeline.balance {pp['balance']!r} is not one of {', '.join(BALANCES)}")
    return PipelinePlan(pp["blocks"], list(before), list(after), pp.get("balance", "cost"))


def _mapping(source: dict, key: str, name: str) -> dict:
    value = source.get(key) or {}
    if not isinstance(value, dict):
        raise PlanError(f"{name}: {key} must be a mapping, got {type(value).__name__}")
    return value


def _only_keys(mapping: dict, valid: tuple, where: str) -> None:
    unknown = sorted(set(mapping) - set(valid))
    if unknown:
        raise PlanError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(valid)}")


def _style(value, pattern, name: str) -> Style:
    if isinstance(value, dict):
        _only_keys(value, ("style", "parts"), f"{name}: tensor_parallel[{pattern!r}]")
        style, parts = value.get("style"), value.get("parts", 1)
    else:
        style, parts = value, 1
    if style not in STYLES:
        raise PlanError(f"{name}: {pattern}: unknown style {style!r}; valid: {', '.join(STYLES)}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or (parts > 1 and style != "colwise"):
        raise PlanError(f"{name}: {pattern}: parts must be a positive integer, and only colwise takes it")
    return Style(style, parts)


def matches(pattern: str, path: str) -> bool:
    """`layers.*.attn.wq` matches `layers.3.attn.wq`: '*' (or any glob) within one path part."""
    pattern_parts, path_parts = pattern.split("."), path.split(".")
    return len(pattern_parts) == len(path_parts) and all(map(fnmatchcase, path_parts, pattern_parts))


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if name and matches(pattern, name)]


def styled_modules(model: nn.Module, plan: Plan) -> dict[str, tuple[nn.Module, Style]]:
    """Module path -> (module, style) for every module the tensor-parallel plan names."""
    styled, matched_by = {}, {}
    for pattern, style in plan.tensor_parallel.items():
        found = matching_modules(model, pattern)
        if not found:
            raise PlanError(f"{plan.source}: tensor_parallel pattern {pattern!r} matches no module of "
                            f"{type(model).__name__}")
        for name, module in found:
            if name in styled and styled[name][1] != style:
                raise PlanError(f"{plan.source}: module {name} is matched by {matched_by[name]!r} and {pattern!r} "
                                "with different styles")
            styled[name], matched_by[name] = (module, style), pattern
    return styled


def head_count_modules(model: nn.Module, plan: Plan, styled: dict) -> dict[str, tuple[nn.Module, list[str]]]:
    """Modules whose head counts tp divides: named by the plan, or declaring `head_count_attrs`
    and holding a module the plan splits."""
    found = {}
    for pattern, attrs in plan.head_counts.items():
        modules = matching_modules(model, pattern)
        if not modules:
            raise PlanError(f"{plan.source}: head_counts pattern {pattern!r} matches no module")
        for name, module in modules:
            found[name] = (module, attrs)
    for name, module in model.named_modules():
        declared = getattr(type(module), "head_count_attrs", None)
        if declared and name not in found and any(s.startswith(f"{name}.") for s in styled):
            found[name] = (module, list(declared))
    return found


# Names attention modules commonly keep their head counts under: a module holding one, whose
# projections the plan splits, must say whether tp divides it (a missed one gives wrong heads
# with no shape error; `head_counts: {module: []}` says the module reads them from its input).
HEAD_COUNT_NAMES = ("heads", "n_heads", "n_head", "num_heads", "n_kv_heads", "n_kv_head", "kv_heads",
                    "num_kv_heads", "num_key_value_heads", "num_attention_heads")


def _undivided_head_counts(model: nn.Module, styled: dict, heads: dict) -> list[str]:
    problems = []
    for name, module in model.named_modules():
        if name in heads or not any(s.startswith(f"{name}.") for s in styled):
            continue
        found = [attr for attr in HEAD_COUNT_NAMES if isinstance(getattr(module, attr, None), int)]
        if found:
            problems.append(f"{name}: has {found[0]} ({getattr(module, found[0])}), a head count the plan does not "
                            f"divide: list it in head_counts (or the module with [] if it reads its heads from its input)")
    return problems


def tp_problems_of(model: nn.Module, plan: Plan, tp: int, sequence_parallel: bool = False,
                   sequence_length: int | None = None) -> list[str]:
    """One line per reason the plan cannot split `model` over `tp` ranks (a model built on the
    meta device will do: only shapes and attributes are read)."""
    try:
        styled = styled_modules(model, plan)
        heads = head_count_modules(model, plan, styled)
    except PlanError as error:
        return [str(error)]
    problems = []
    fits = {"vocab_head": nn.Linear, "vocab_embed": nn.Embedding}
    for name, (module, style) in styled.items():
        kind, shape = fits.get(style.name), linear_shape(module)
        if style.name in ("colwise", "rowwise") and shape is None:
            problems.append(f"{name}: style {style.name} needs an nn.Linear (or transformers' Conv1D), "
                            f"but the module is a {type(module).__name__}")
        elif kind is not None and not isinstance(module, kind):
            problems.append(f"{name}: style {style.name} needs an nn.{kind.__name__}, "
                            f"but the module is a {type(module).__name__}")
        elif style.name == "colwise" and shape[1] % (style.parts * tp):
            problems.append(f"{name}: colwise splits out_features ({shape[1]}) into "
                            f"{style.parts} part(s) x tp ({tp}), which does not divide it")
        elif style.name == "rowwise" and shape[0] % tp:
            problems.append(f"{name}: rowwise splits in_features ({shape[0]}), "
                            f"which tp ({tp}) does not divide")
        elif style.name in ("vocab_embed", "replicate") and isinstance(module, nn.Embedding) and (
                module.padding_idx is not None or module.max_norm is not None or module.sparse):
            problems.append(f"{name}: {style.name} supports plain embeddings only (no padding_idx, max_norm, sparse)")
    problems += _undivided_head_counts(model, styled, heads)
    for name, (module, attrs) in heads.items():
        for attr in attrs:
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                problems.append(f"{name}: has no integer attribute {attr!r} holding a head count")
            elif value % tp:
                problems.append(f"{name}: {attr} ({value}) is not divisible by tp ({tp}): each rank computes whole heads")
    if sequence_parallel and tp > 1:
        if not plan.gather_inputs:
            problems.append(f"{plan.source}: sequence parallelism needs sequence_parallel.gather_inputs "
                            "(the modules whose input is gathered along the sequence)")
        for pattern in plan.gather_inputs:
            if not matching_modules(model, pattern):
                problems.append(f"{plan.source}: sequence_parallel pattern {pattern!r} matches no module")
        if sequence_length is not None and sequence_length % tp:
            problems.append(f"sequence length {sequence_length} is not divisible by tp ({tp}), "
                            "as sequence parallelism needs")
    return problems


def resolve(model: nn.Module, path: str, plan: Plan) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise PlanError(f"{plan.source}: pipeline names {path!r}, which is no module of "
                        f"{type(model).__name__}") from None


def pipeline_problems(model: nn.Module, plan: Plan, chunks: int) -> list[str]:
    """One line per reason the plan cannot cut `model` into `chunks` pipeline chunks."""
    if plan.pipeline is None:
        return [f"{plan.source}: has no pipeline section (blocks, before, after), so pp must be 1"]
    try:
        layers = pipeline_layers(model, plan)
    except PlanError as error:
        return [str(error)]
    problems = []  # too few layers for the chunks is the caller's check (it knows the schedule)
    first, last = layers[0], layers[-1]
    shared = {id(p) for p in first.parameters()} & {id(p) for p in last.parameters()}
    if shared and chunks > 1:
        problems.append(f"{plan.source}: a parameter is used both before and after the blocks (tied "
                        "embeddings?): pipeline stages cannot share it; untie it or use pp = 1")
    return problems


class RunInOrder(nn.Module):
    """Modules applied one after the other: what the plan says runs before or after the blocks."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        for part in self.parts:
            x = part(x)
        return x


def pipeline_layers(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """[before, *blocks, after]: the model as an ordered list of layers whose composition is its
    forward. The layers hold the model's own modules (same parameters, same names in the model)."""
    pp = plan.pipeline
    if pp is None:
        raise PlanError(f"{plan.source}: has no pipeline section")
    blocks = resolve(model, pp.blocks, plan)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
        raise PlanError(f"{plan.source}: pipeline.blocks {pp.blocks!r} must be a non-empty ModuleList, "
                        f"got {type(blocks).__name__}")

    def part(entry):
        return entry(model) if callable(entry) else resolve(model, str(entry), plan)

    return [RunInOrder([part(e) for e in pp.before]), *blocks, RunInOrder([part(e) for e in pp.after])]


def block_list(model: nn.Module, plan: Plan | None = None) -> nn.ModuleList | nn.Sequential | None:
    """The model's repeated blocks, in the order its forward calls them: the plan's pipeline.blocks;
    without one, what the model's structure says: a Sequential model's own layers, or the one
    ModuleList (or Sequential) among its children that holds parameters (a CNN's conv blocks, an
    MLP stack's layers). None when neither says (the model is then one piece to FSDP)."""
    if plan is not None and plan.pipeline is not None:
        return resolve(model, plan.pipeline.blocks, plan)
    if isinstance(model, nn.Sequential):
        return model
    lists = [child for child in model.children() if isinstance(child, (nn.ModuleList, nn.Sequential))
             and any(True for _ in child.parameters())]
    return lists[0] if len(lists) == 1 else None
