"""Every extension point of lcx, in one file.

A long-context method is a plugin that implements some of the *stages* below.
Reading this file top to bottom tells you the whole architecture:

    discovery     lcx_register_methods   which methods a plugin provides
                  lcx_register_tasks     which synthetic training tasks (``--data task:NAME``) it provides
                  lcx_register_commands  which commands it adds to the ``lcx`` command line
    1 chunking    lcx_plan               how a long input is split (local / memory / windows)
    2 memory      lcx_memory             the store of (key, value) that outlives one window
    3 attention   lcx_patch_model        reversible changes to the model at attach time
                  lcx_attention          what one attention layer computes
    4 sampling    lcx_sample             training-time reshaping of a batch
    5 loss        lcx_loss               named loss terms the trainer sums

Two plugin managers exist.  The *global* one (``lcx.registry``) holds plugins
(in-tree modules and third-party packages from the ``lcx.methods`` entry-point
group) and only answers the discovery hooks.  Each call to ``lcx.attach``
builds a *per-run* manager that holds only the method instances the user chose,
so an installed but unselected method never fires.

Stages marked EXCLUSIVE accept one implementation per run: two selected methods
that both implement one are refused by ``attach`` with a message naming both.

Hook implementations must not give their arguments default values (pluggy 1.6 and
1.7 treat them differently).

Besides the stages, a method answers questions lcx asks it at other times: the
attributes and methods of ``lcx.method.Method`` (defaults there), by when they are
asked:

    attach        requires, idle_stages                   families it needs; stages its options leave idle
                  resolve_auto                            ``auto`` options measured on the model (``lcx.auto``)
                  fix_length                              serving and training: the longest request fixes
                                                          what follows a request's length
    each request  release                                 drop the last request's own state (``run.state``)
                  begin_request                           set what follows its length (rope's factor=auto)
                  memory_entries, generation_entries,     ``lcx.limits``: its memory's entries and bytes,
                  memory_bytes, memory_device,            where they live, the cache it keeps, its largest
                  cache_tokens, forward_shapes,           forward passes, and the option that makes them
                  forward_hint                            smaller (said when a request is refused)
                  reusable_prefix                         whether prompts sharing a start share its memory
                  reach                                   whether it reads a span of a prompt, and how
                                                          (``lcx demo``'s why column)
                  reads_past_window                       whether it reads prompts longer than the window
                                                          (transformers' reminder is then muted)
                  request_options                         what its request ran with (``lcx generate --json``)
    listing       resolved                                its model-dependent options on a model
                                                          (``lcx methods -m``)
    documents     reads_memory, load_memory,              ``lcx generate|serve --memory``: a document memory
                  check_memory, shapes_memory,            it reads, checked before it is trusted; the options
                  memory_built_otherwise,                 that shaped its entries, and those it was built
                  memory_built_note                       with otherwise (said in a note)
    training      lora_roles, lora_gated, data_order,     what ``lcx train`` adapts, how its data is ordered,
                  fixed_by_training, inference_only,      the options a trained adapter fixes and those it
                  grads_through_cache, check_training,    does not carry, whether FSDP2 keeps blocks gathered
                  begin_training                          through backward, options training refuses, and
                                                          that it trains (its inference-only autos unmeasured)
    serving       serving, not_served_because,            how vLLM serves it (``lcx serve``, ``lcx export``):
                  check_serving, vllm_config,             as the plain model, a rewritten config, rewritten
                  serve_prompt, serve_state,              prompts, per-request state computed by lcx's
                  serve_request, serves_prefix_kv,        middleware, or inside vLLM's attention through the
                  served_attention                        ``ServedAttention`` class its plugin names

What lcx shares with methods while it runs is on the ``Run`` (``lcx.composition``):
``plan``, ``memory``, ``reuse``, ``scored``, ``seed``, ``rank``, ``train_state``;
``run.state`` holds each method's own values, under keys it prefixes with its name.
"""

from __future__ import annotations

import pluggy

PROJECT = "lcx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------- discovery
@hookspec
def lcx_register_methods(register):
    """At plugin load: call ``register(MethodClass)`` once per method this plugin provides. Collected."""


@hookspec
def lcx_register_tasks(register):
    """At plugin load: call ``register(lcx.data.Task(name, make, help))`` once per synthetic training task. Collected.

    ``lcx train --data task:NAME:ARG1:ARG2`` calls ``make(["ARG1", "ARG2"])``, which returns (or raises an
    ``LcxError`` naming the ARG it refuses) a function ``(random.Random, batch_size, seq_len) -> batch``:
    ``input_ids``, ``attention_mask``, ``labels`` of shape (B, T), a pure function of the random generator it is
    given (the trainer seeds it by seed, step, micro-batch and rank, which makes resuming exact).
    """


@hookspec
def lcx_register_commands(cli):
    """When the ``lcx`` command line first needs a command it lacks: add this plugin's click commands. Collected.

    ``cli`` is the root ``click.Group``: ``cli.add_command(cmd)`` adds a top-level command and
    ``cli.commands["analyze"].add_command(cmd)`` a command to an existing group (``memory``, ``analyze``, ...).
    It runs when a group is asked for a command it does not have (``lcx memory build``) or for its list
    (``lcx memory --help``).  ``lcx --help`` lists the core's commands without loading plugins, to stay fast:
    a new top-level command runs but is not listed there; a command in a group is listed by the group's help.
    """


# --------------------------------------------------------------------- 1 chunking
@hookspec(firstresult=True)
def lcx_plan(run, input_ids, attention_mask, max_new_tokens):
    """Before generation: turn a long input into a ``lcx.plan.Plan``. EXCLUSIVE, first result.

    Gets the run, ``input_ids`` (B, T) and ``attention_mask`` (B, T) of the whole
    prompt, and the generation budget.  Returns a Plan saying which tokens the
    model sees, which are prefilled window by window into memory, and at which
    positions; ``None`` means "feed the input as it is".
    """


# --------------------------------------------------------------------- 2 memory
@hookspec(firstresult=True)
def lcx_memory(run, batch_size):
    """Before a forward pass over a new input: create the method's memory. EXCLUSIVE, first result.

    Returns a ``transformers.Cache`` (a custom Cache subclass may keep, evict,
    re-rotate or retrieve entries) used as ``past_key_values`` for the whole
    input; ``None`` means the model's ordinary ``DynamicCache``.
    """


# --------------------------------------------------------------------- 3 attention
@hookspec
def lcx_patch_model(run, model):
    """At attach time, once: change the model, reversibly. Collected.

    Register every change on ``run.patches`` (a ``contextlib.ExitStack``) so that
    detaching undoes it; e.g. ``run.patches.callback(restore)`` or
    ``run.patches.enter_context(...)``.  Returns nothing.
    """


@hookspec(firstresult=True)
def lcx_attention(run, module, query, key, value, attention_mask, kwargs):
    """In every attention layer's forward: compute attention. EXCLUSIVE, first result.

    Gets the attention module (``module.layer_idx`` is set), ``query`` (B, Hq, T, D),
    ``key``/``value`` (B, Hkv, S, D) as returned by the cache (already rotated),
    the 4D mask built by the base implementation's mask function (or None), and
    the remaining keyword arguments transformers passed (``scaling``, ``dropout``,
    ``sliding_window``, ...).  Returns ``(output (B, T, Hq, D), weights | None)``,
    or ``None`` to let the base implementation (sdpa / eager) compute this layer.
    ``run.base_attention(module, query, key, value, attention_mask, **kwargs)``
    calls the base implementation.
    """


# --------------------------------------------------------------------- 4 sampling
@hookspec(firstresult=True)
def lcx_sample(run, batch, step):
    """In training, before each forward: reshape a batch. EXCLUSIVE, first result.

    Gets a dict batch (``input_ids``, ``attention_mask``, ``labels`` ...) and the
    optimizer step.  Returns the batch to feed (may add ``position_ids`` or
    extra keys its loss stage reads); ``None`` means "use it unchanged".
    """


# --------------------------------------------------------------------- 5 loss
@hookspec
def lcx_loss(run, model, batch):
    """In training, for each batch: return named loss terms. Collected.

    Returns ``{"name": scalar tensor}``; the trainer sums every term from every
    method and logs each separately.  Returning nothing leaves the ordinary
    next-token loss as the only term.
    """


#: Hooks of the global plugin manager (``lcx.registry``): what plugins provide, not stages of a run.
DISCOVERY: tuple[str, ...] = ("lcx_register_methods", "lcx_register_tasks", "lcx_register_commands")

#: Stages that accept one implementation per run, with the name users see.
EXCLUSIVE_STAGES: dict[str, str] = {
    "lcx_plan": "chunking",
    "lcx_memory": "memory",
    "lcx_attention": "attention",
    "lcx_sample": "sampling",
}

#: Every stage hook with the name users see (for `lcx methods`).
STAGES: dict[str, str] = {
    **EXCLUSIVE_STAGES,
    "lcx_patch_model": "patching",
    "lcx_loss": "loss",
}
