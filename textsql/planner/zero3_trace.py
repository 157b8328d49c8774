"""What ZeRO-3 keeps gathered on a GPU: the order of its module hooks in one training step (recorded on a narrow copy of
the model), and a replay of DeepSpeed's PartitionedParameterCoordinator on it. textsql.planner.shape records the trace, textsql.planner.states replays it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class ModuleTrace:
    """The order in which ZeRO-3's module hooks fire during one training step, recorded on a narrow copy of the model.

    Compared by identity: one trace per model config (_inspect_model is cached), so hashing a plan input stays cheap.
    """

    module_parameters: (
        tuple  # per module (model.modules() order): indexes of its own parameters (model.parameters() order)
    )
    external: tuple  # (module, parameter): a parameter the module's code reads while no module holding it runs
    step: tuple  # (module, is_fetch) for the forward and backward pass, in time order
    checkpointed_step: (
        tuple  # the same with gradient checkpointing (every checkpointed layer recomputed in the backward)
    )


# Widths of the narrow copy whose training step gives the module trace (same layers, same parameters, tiny tensors).
NARROW_WIDTHS = {"d_model": 8, "d_ff": 8, "d_kv": 4, "num_heads": 2, "vocab_size": 16}


def record_module_trace(model) -> ModuleTrace | None:
    """Train the model for a step (on zeros: only the order of the hooks matters) with hooks that fire where
    ZeRO-3's do (DeepSpeed 0.19.8, deepspeed/runtime/zero/parameter_offload.py, _register_deepspeed_module):
    - a fetch before and a release after every module's forward;
    - a fetch each time a gradient reaches one of a module's output tensors (PreBackwardFunctionForModule wraps every
      output tensor), and a release once the gradients of all its input tensors that require one are computed
      (PostBackwardFunctionModule; a module none of whose positional inputs requires a gradient, such as an embedding
      or T5's relative attention bias, gets no release in the backward pass);
    - a parameter read by a module that does not own it while no module holding it runs (T5's feed-forward block
      reads `wo.weight` to pick a dtype) becomes that module's external parameter, as ZeROOrderedDict registers it.
    The autograd engine orders the backward hooks, and replays checkpointed layers, as it does for DeepSpeed.
    Returns None if the step fails.
    """
    import torch

    index = {id(p): i for i, p in enumerate(model.parameters())}
    modules = list(model.modules())
    position = {id(m): j for j, m in enumerate(modules)}
    own = [frozenset(index[id(p)] for p in m.parameters(recurse=False)) for m in modules]
    events, external, stack, grads_remaining = [], {}, [], {}

    class Reads(dict):  # a module's _parameters that reports reads, like DeepSpeed's ZeROOrderedDict
        def __getitem__(self, key):
            param = super().__getitem__(key)
            if param is not None and stack and id(param) in index:
                p = index[id(param)]
                if not any(p in own[j] or (j, p) in external for j in stack):  # not gathered by a running module
                    external[(stack[-1], p)] = True
            return param

    class Marked(torch.autograd.Function):  # passes a tensor through, remembering the module, as DeepSpeed's do
        @staticmethod
        def forward(ctx, module, tensor):
            ctx.module = module
            return tensor.detach()

    class BeforeBackward(Marked):
        @staticmethod
        def backward(ctx, grad):
            events.append((ctx.module, True))
            return None, grad

    class AfterBackward(Marked):
        @staticmethod
        def backward(ctx, grad):
            grads_remaining[ctx.module] -= 1
            if grads_remaining[ctx.module] == 0:
                events.append((ctx.module, False))
            return None, grad

    def wrap(function, module, value):  # DeepSpeed's apply_to_tensors_only
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(wrap(function, module, v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(wrap(function, module, v) for v in value)
        if isinstance(value, dict):
            for key in value.keys():
                value[key] = wrap(function, module, value[key])
            return value
        if isinstance(value, torch.Tensor) and value.requires_grad:
            if function is AfterBackward:
                grads_remaining[module] += 1
            return function.apply(module, value)
        return value

    def before_forward(module, args):
        j = position[id(module)]
        stack.append(j)
        events.append((j, True))
        grads_remaining[j] = 0
        return wrap(AfterBackward, j, args)

    def after_forward(module, args, output):
        j = stack.pop()
        events.append((j, False))
        return wrap(BeforeBackward, j, output)

    def step() -> tuple:
        events.clear()
        ids = torch.zeros((1, 8), dtype=torch.long)
        # no attention mask: checking it for padding needs data; a causal LM reads input_ids alone
        decoder = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
        output = model(input_ids=ids, **decoder, use_cache=False)
        output.logits.sum().backward()
        return tuple(events)

    steps = _with_hooks(model, modules, Reads, before_forward, after_forward, step)
    if steps is None:
        return None
    plain, checkpointed = steps
    return ModuleTrace(
        module_parameters=tuple(tuple(sorted(o)) for o in own),
        external=tuple(external),
        step=plain,
        checkpointed_step=checkpointed,
    )


def zero3_step_events(trace: ModuleTrace, persistent, gradient_checkpointing: bool) -> tuple[tuple, list]:
    """(events, parameters per module) of one training step as ZeRO-3's hooks fire them.

    An external parameter counts only if it is not persistent: a persistent one is always gathered, and DeepSpeed
    registers a parameter only when it finds it NOT_AVAILABLE.
    """
    module_parameters = [set(own) for own in trace.module_parameters]
    for module, parameter in trace.external:
        if parameter not in persistent:
            module_parameters[module].add(parameter)
    events = trace.checkpointed_step if gradient_checkpointing else trace.step
    return events, [tuple(sorted(p)) for p in module_parameters]


def simulate_parameter_coordinator(
    sizes,
    events,
    module_parameters,
    persistent,
    prefetch_bucket_size: int,
    max_live_parameters: int,
    max_reuse_distance: int,
) -> dict:
    """Replay one training step (after the first, which records the trace) of DeepSpeed 0.19.8's ZeRO-3
    PartitionedParameterCoordinator (deepspeed/runtime/zero/partitioned_param_coordinator.py): the parameter elements
    it holds gathered after every fetch (its __n_available_params, persistent parameters not counted) as `timeline`,
    and their peak.

    As the coordinator does:
    - fetch_sub_module gathers the module's parameters that are not available, pops them off the trace's parameter
      queue, then prefetches from the queue up to min(stage3_max_live_parameters - gathered, stage3_prefetch_bucket_size)
      elements (max_live_parameters caps prefetching only: a fetch the module needs always happens, and kept parameters
      may exceed it);
    - release_sub_module releases a module's parameters after it ran unless persistent (stage3_param_persistence_
      threshold), still used by a running module, skipped by a prefetch for a later use (__most_recent_step_id_param_
      fetched_for), or used again within the next stage3_max_reuse_distance elements of the trace (__params_to_release
      walks the trace from the current step, adding each module's parameter sizes, until the sum reaches the distance).
    """
    import bisect
    from collections import defaultdict, deque

    order = [module for module, is_fetch in events if is_fetch]  # the coordinator's __submodule_order
    prefix = [0]
    for module in order:
        prefix.append(prefix[-1] + sum(sizes[p] for p in module_parameters[module]))
    uses = defaultdict(list)  # parameter -> steps using it, ascending
    for step, module in enumerate(order):
        for p in module_parameters[module]:
            uses[p].append(step)

    def reused_soon(p, step):
        if max_reuse_distance <= 0:
            return False
        # the walk covers order[step:last + 1]: it stops before a module once the sizes added reach the distance
        last = bisect.bisect_left(prefix, prefix[step] + max_reuse_distance, lo=step + 1) - 1
        at = bisect.bisect_left(uses[p], step)
        return at < len(uses[p]) and uses[p][at] <= last

    queue = deque((p, step) for step, module in enumerate(order) for p in module_parameters[module])
    most_recent = defaultdict(lambda: -(10**10))
    active = defaultdict(set)
    gathered: set = set()
    live = peak = peak_step = step = 0
    timeline = []
    for module, is_fetch in events:
        params = module_parameters[module]
        if is_fetch:
            not_fetched_yet = {p for p in params if most_recent[p] < step}
            for p in params:
                active[p].add(module)
                if p not in gathered and p not in persistent:
                    gathered.add(p)
                    live += sizes[p]
            popped = set()
            while queue and len(popped) < len(not_fetched_yet):
                p, used_at = queue.popleft()
                most_recent[p] = used_at
                popped.add(p)
            if prefetch_bucket_size > 0:
                budget, prefetching = min(max_live_parameters - live, prefetch_bucket_size), 0
                while queue and prefetching < budget:
                    p, used_at = queue.popleft()
                    if p not in gathered and p not in persistent:
                        gathered.add(p)
                        live += sizes[p]
                        prefetching += sizes[p]
                    most_recent[p] = max(most_recent[p], used_at)
            timeline.append(live)
            if live > peak:
                peak, peak_step = live, step
            step += 1
        else:
            for p in params:
                active[p].discard(module)
                if p in gathered and not active[p] and most_recent[p] <= step and not reused_soon(p, step):
                    gathered.discard(p)
                    live -= sizes[p]
    return {"peak_gathered": peak, "peak_step": peak_step, "steps": len(order), "timeline": timeline}


def _with_hooks(model, modules: list, reads: type, before_forward, after_forward, step) -> tuple | None:
    """The module trace's two steps (plain, then with activation checkpointing) with the hooks on every module and its
    parameters read through `reads`; everything put back after. None if a step fails."""
    import torch

    saved = [m._parameters for m in modules]
    handles = []
    for m in modules:
        m._parameters = reads(m._parameters)
        handles += [m.register_forward_pre_hook(before_forward), m.register_forward_hook(after_forward)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only spin, 3x slower on a busy machine
    try:
        model.train()
        plain = step()
        model.activation_checkpointing_enable({"use_reentrant": False, "preserve_rng_state": False})
        return plain, step()
    except Exception:  # noqa: BLE001 - a model whose step fails here: the planner falls back to an upper bound
        return None
    finally:
        torch.set_num_threads(threads)
        for m, parameters in zip(modules, saved):
            m._parameters = parameters
        for handle in handles:
            handle.remove()
