"""The click-through model over a DataFeedDesc's used slots, and its programs.

Each used uint64 slot has an embedding table of its own (where the mode keeps tables:
``role.embedding``).  On parameter servers with ``ctr.ids=raw`` every id keeps a row of its
own (``sparse_embedding`` keys rows by the raw uint64 id); elsewhere ids are hashed into
``ctr.hash_size`` rows.  A variable-length (LoD) slot's embeddings are summed, float slots
join as they are, and a small ReLU tower gives the click logit.  On the servers each
instance pushes one show and its label as click with its ids (``ShowClickEntry``), which
the tables score, filter and evict by (:mod:`kspipe.ctr.tables`).

The exported model of raw-id tables looks ids up in the rows the tables hold
(:func:`key_lookup`): a sorted array of the ids beside the rows, an unknown id the last
row (zeros).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kspipe.ctr.metrics import accumulate
from kspipe.ctr.tables import CLICK, SHOW
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
    raw_ids: bool = False  # ids keep rows of their own on the servers (not hashed)
    dataset: object = None  # the data set the programs read (its slots)
    sums: list = field(default_factory=list)  # the pass's accumulated sums (kspipe.ctr.metrics)
    stream_save: str = ""  # a stream's last save, which its exported model serves


def build(cfg, dataset, role) -> CtrPrograms:
    """The training program (tables where ``role`` keeps them) and the export program."""
    import paddle

    m = cfg.ctr
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = cfg.seed
    raw = raw_ids(cfg)
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        tables = functools.partial(role.embedding, feeding="dataset")  # train_from_dataset
        net = network(dataset, m, tables, with_label=True, hashed=not raw)
    infer, infer_net = infer_program(dataset, m, local_embedding, hashed=True)
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
        raw_ids=raw,
        dataset=dataset,
        sums=net["sums"],
    )


def raw_ids(cfg) -> bool:
    """Whether ids keep rows of their own: ``ctr.ids=raw`` on parameter servers."""
    return cfg.ctr.ids == "raw" and cfg.mode == "pserver"


def infer_program(dataset, m, embedding, hashed: bool):
    """The prediction program (no label), its parameters named as the trained ones."""
    import paddle

    infer = paddle.static.Program()
    with (
        paddle.utils.unique_name.guard(),
        paddle.static.program_guard(infer, paddle.static.Program()),
    ):
        return infer, network(dataset, m, embedding, with_label=False, hashed=hashed)


def key_lookup(sizes: dict):
    """An embedding over the rows a raw-id table holds: ``sizes`` gives each table's
    rows; the scope holds ``<table>`` (those rows, then a row of zeros for unknown ids)
    and ``<table>.keys`` (their ids as int64, ascending)."""

    def embedding(ids, size, param_attr):
        import paddle

        name = param_attr.name
        rows = sizes[name]
        keys = paddle.static.create_global_var(
            [max(rows, 1)], 0, "int64", persistable=True, name=f"{name}.keys"
        )
        flat = paddle.reshape(ids, [-1])
        at = paddle.minimum(paddle.searchsorted(keys, flat), paddle.full([1], rows - 1, "int64"))
        at = paddle.maximum(at, paddle.zeros([1], "int64"))
        known = paddle.equal(paddle.gather(keys, at), flat)
        at = paddle.reshape(paddle.where(known, at, paddle.full_like(at, rows)), ids.shape)
        if ids.lod_level:  # the sequences as the ids had them
            block = at.block
            out = block.create_var(dtype="int64", shape=ids.shape, lod_level=ids.lod_level)
            block.append_op(
                type="lod_reset",
                inputs={"X": at, "Y": ids},
                outputs={"Out": out},
                attrs={"append": False},
            )
            at = out
        return paddle.static.nn.embedding(
            at, size=[rows + 1, size[1]], is_sparse=False, param_attr=param_attr
        )

    return embedding


def local_embedding(ids, size, param_attr):
    import paddle

    return paddle.static.nn.embedding(ids, size=size, is_sparse=True, param_attr=param_attr)


def network(dataset, m, embedding, with_label: bool, hashed: bool = True) -> dict:
    """The model over ``dataset``'s used slots; parameters named so programs share them.
    ``hashed``: ids modulo ``m.hash_size``; else as they are (raw uint64 keys)."""
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
        if hashed:  # int64 remainder: an id above 2**63 (negative here) lands in range too
            ids = paddle.remainder(var, paddle.full([1], m.hash_size, "int64"))
        else:
            ids = var
        name = f"emb_{slot.name}"
        attr = paddle.ParamAttr(name=name, initializer=init)
        size = [m.hash_size, m.embedding_dim]  # sparse_embedding ignores the rows
        emb = embedding(ids, size, attr)
        if with_label:
            show_click(emb)
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
        shows_and_clicks(label_var)
        loss = paddle.mean(
            paddle.nn.functional.binary_cross_entropy_with_logits(
                logit, paddle.cast(label_var, "float32")
            )
        )
        _, _, stats = paddle.static.auc(paddle.concat([1.0 - pred, pred], axis=1), label_var)
        net.update(
            loss=loss,
            stat_pos=stats[2].name,
            stat_neg=stats[3].name,
            sums=accumulate(pred, label_var),
        )
    return net


def show_click(emb) -> None:
    """The servers' lookup of ``emb`` pushes each instance's show and click
    (``ShowClickEntry``: Paddle's trainer pass reads the lookup op's ``entry``)."""
    op = next(op for op in reversed(emb.block.ops) if emb.name in op.output_arg_names)
    if op.type == "lookup_table" and op.attr("is_distributed"):
        op._set_attr("entry", f"show_click_entry:{SHOW}:{CLICK}")


def shows_and_clicks(label) -> None:
    """``ctr_show`` (1 for each instance) and ``ctr_click`` (its label), as floats."""
    import paddle

    block = label.block
    click = paddle.cast(label, "float32")
    for name, value in ((SHOW, paddle.ones_like(click)), (CLICK, click)):
        var = block.create_var(name=name, dtype="float32", shape=[-1, 1], stop_gradient=True)
        paddle.assign(value, output=var)


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
