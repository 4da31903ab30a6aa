"""The click-through model over a DataFeedDesc's used slots, and its programs.

Each used uint64 slot's ids are hashed into ``ctr.hash_size`` rows of an embedding table
of its own (where the mode keeps tables: ``role.embedding``); a variable-length (LoD)
slot's embeddings are summed, float slots join as they are, and a small ReLU tower gives
the click logit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kspipe.errors import ConfigError


@dataclass
class CtrPrograms:
    startup: object
    main: object  # one training step (after the compile stage: with its optimiser)
    infer: object  # prediction with plain embedding tables, for export
    loss: object
    pred: object
    stat_pos: str  # the AUC op's accumulated histograms (persistable)
    stat_neg: str
    feed_names: list  # used slots, in file order
    infer_feeds: list  # the infer program's feed variables (no label)
    infer_pred: object
    tables: dict  # embedding parameter -> (slot, lookup output variable, ids per instance or 0)
    learning_rate: float
    test: object = None  # set by the compile stage: prediction only, over the trained variables
    fetch: dict = field(default_factory=dict)  # name shown -> variable printed while training
    export_scope: object = None  # every trained variable of ``infer``, tables pulled


def build(cfg, dataset, role) -> CtrPrograms:
    """The training program (tables where ``role`` keeps them) and the export program."""
    import paddle

    m = cfg.ctr
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = cfg.seed
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        tables = functools.partial(role.embedding, feeding="dataset")  # train_from_dataset
        net = network(dataset, m, tables, with_label=True)
    infer = paddle.static.Program()  # its parameters are the trained ones, shared by name
    unused_startup = paddle.static.Program()
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(infer, unused_startup):
        infer_net = network(dataset, m, local_embedding, with_label=False)
    return CtrPrograms(
        startup=startup,
        main=main,
        infer=infer,
        loss=net["loss"],
        pred=net["pred"],
        stat_pos=net["stat_pos"],
        stat_neg=net["stat_neg"],
        feed_names=[v.name for v in net["feeds"]],
        infer_feeds=infer_net["feeds"],
        infer_pred=infer_net["pred"],
        tables=net["tables"],
        learning_rate=float(m.learning_rate),
    )


def local_embedding(ids, size, param_attr):
    import paddle

    return paddle.static.nn.embedding(ids, size=size, is_sparse=True, param_attr=param_attr)


def network(dataset, m, embedding, with_label: bool) -> dict:
    """The model over ``dataset``'s used slots; parameters named so programs share them."""
    import paddle

    desc, label = dataset.desc, dataset.label
    init = paddle.nn.initializer.Uniform(-0.05, 0.05)
    feeds, parts, tables, label_var = [], [], {}, None
    for slot in desc.used_slots:
        if slot.name == label and not with_label:
            continue
        dtype = "int64" if slot.type == "uint64" else "float32"
        if slot.is_dense:
            width = dataset.dense_width[slot.name]
            var = paddle.static.data(slot.name, [-1, width], dtype)
        else:
            var = paddle.static.data(slot.name, [-1, 1], dtype, lod_level=1)
        feeds.append(var)
        if slot.name == label:
            label_var = var
            continue
        if slot.type == "float":
            parts.append(var if slot.is_dense else paddle.static.nn.sequence_pool(var, "sum"))
            continue
        ids = paddle.remainder(var, paddle.full([1], m.hash_size, "int64"))
        name = f"emb_{slot.name}"
        attr = paddle.ParamAttr(name=name, initializer=init)
        size = [m.hash_size, m.embedding_dim]
        emb = embedding(ids, size, attr)
        tables[name] = (slot.name, emb.name, dataset.dense_width.get(slot.name, 0))
        if slot.is_dense:  # a fixed number of ids per instance: their embeddings side by side
            parts.append(
                paddle.reshape(emb, [-1, dataset.dense_width[slot.name] * m.embedding_dim])
            )
        else:
            parts.append(paddle.static.nn.sequence_pool(paddle.squeeze(emb, axis=1), "sum"))
    x = paddle.concat(parts, axis=1) if len(parts) > 1 else parts[0]
    for i, size in enumerate(m.hidden):
        x = paddle.static.nn.fc(
            x,
            size,
            activation="relu",
            weight_attr=paddle.ParamAttr(name=f"tower_{i}.w"),
            bias_attr=paddle.ParamAttr(name=f"tower_{i}.b"),
        )
    logit = paddle.static.nn.fc(
        x,
        1,
        weight_attr=paddle.ParamAttr(name="tower_out.w"),
        bias_attr=paddle.ParamAttr(name="tower_out.b"),
    )
    pred = paddle.nn.functional.sigmoid(logit)
    net = {"feeds": feeds, "pred": pred, "tables": tables}
    if with_label:
        loss = paddle.mean(
            paddle.nn.functional.binary_cross_entropy_with_logits(
                logit, paddle.cast(label_var, "float32")
            )
        )
        _, _, stats = paddle.static.auc(paddle.concat([1.0 - pred, pred], axis=1), label_var)
        net.update(loss=loss, stat_pos=stats[2].name, stat_neg=stats[3].name)
    return net


def fetch_vars(programs, names: list[str]) -> dict:
    """The variables of ``datafeed.fetch`` (``loss`` names the model's loss)."""
    block = programs.main.global_block()
    found = {}
    for name in names:
        if name == "loss":
            found[name] = programs.loss
        elif block.has_var(name):
            found[name] = block.var(name)
        else:
            known = sorted(v.name for v in block.vars.values() if not v.name.endswith("@GRAD"))
            raise ConfigError(
                f"datafeed.fetch: the program has no variable {name!r} "
                f"(loss, or one of: {', '.join(known[:12])}, ...)"
            )
    return found
