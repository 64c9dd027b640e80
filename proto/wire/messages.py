"""The one codec between the shared wire types and their protobuf messages.

``Spec`` <-> ``ObjectSpec``, ``AdapterLayout`` <-> ``AdapterLayout`` (the message), and adapter
tier names <-> the tier enum: the service encodes with these and the client decodes with
them, so the two sides cannot drift apart. Only translation lives here: no validation
beyond what decoding needs, no daemon or client imports.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory_broker.proto.wire.layout import (
    AdapterLayout,
    MatrixPlacement,
    ModulePlacement,
    ModuleShard,
    RowChunk,
    elem_size,
)
from memory_broker.proto.wire.spec import Spec
from memory_broker.proto.wire.v1 import broker_pb2 as pb

# Adapter tier name (the daemon's Tier values) -> proto enum, and back.
TIERS: dict[str, int] = {"hot": pb.ADAPTER_TIER_HOT, "warm": pb.ADAPTER_TIER_WARM, "cold": pb.ADAPTER_TIER_COLD}
TIER_NAMES: dict[int, str] = {v: k for k, v in TIERS.items()}


def spec_to_proto(spec: Spec) -> pb.ObjectSpec:
    return pb.ObjectSpec(
        num_pages=spec.num_pages,
        contiguous=spec.contiguous,
        content_type=spec.content_type_number,
        key=spec.key or b"",
        pin=spec.pin,
    )


def spec_from_proto(msg: pb.ObjectSpec) -> Spec:
    # An empty key on the wire is "no key" (proto3 has no null bytes).
    return Spec(msg.num_pages, msg.content_type, contiguous=msg.contiguous, key=msg.key or None, pin=msg.pin)


def _matrix_to_proto(m: MatrixPlacement) -> pb.MatrixLayout:
    return pb.MatrixLayout(
        rows=m.rows,
        row_elems=m.row_elems,
        row_stride=m.row_stride,
        chunks=[pb.RowChunk(page_index=c.page, offset=c.offset, rows=c.rows) for c in m.chunks],
    )


def layout_to_proto(
    adapter_id: str, layout: AdapterLayout, generation: int, object_id: int, pages: Sequence[int], arena_slabs: int
) -> pb.AdapterLayout:
    """The layout message for one placed adapter (its object's ``pages`` at ``generation``)."""
    return pb.AdapterLayout(
        adapter_id=adapter_id,
        generation=generation,
        object_id=object_id,
        pages=list(pages),
        page_size=layout.page_size,
        dtype=layout.dtype,
        row_align=layout.row_align,
        num_pages=layout.num_pages,
        modules=[
            pb.ModuleLayout(
                layer=m.layer,
                module=m.module,
                rank=m.rank,
                scaling=m.scaling,
                in_features=m.in_features,
                out_features=m.out_features,
                a=_matrix_to_proto(m.a),
                b=_matrix_to_proto(m.b),
            )
            for m in layout.modules
        ],
        arena_slabs=arena_slabs,
        shard=layout.shard,
    )


def _matrix_from_proto(
    layer: int, module: str, kind: str, rank: int, width: int, msg: pb.MatrixLayout
) -> MatrixPlacement:
    chunks = tuple(RowChunk(c.page_index, c.offset, c.rows) for c in msg.chunks)
    return MatrixPlacement(layer, module, kind, rank, width, msg.row_stride, chunks)


def layout_from_proto(msg: pb.AdapterLayout) -> AdapterLayout:
    """The placement record, rebuilt from its wire form.

    Raises:
        ValueError: an unknown dtype.
    """
    modules = []
    for m in msg.modules:
        a = _matrix_from_proto(m.layer, m.module, "A", m.rank, m.in_features, m.a)
        b = _matrix_from_proto(m.layer, m.module, "B", m.rank, m.out_features, m.b)
        modules.append(ModulePlacement(m.layer, m.module, m.rank, m.scaling, m.in_features, m.out_features, a, b))
    return AdapterLayout(
        page_size=msg.page_size,
        dtype=msg.dtype,
        elem_size=elem_size(msg.dtype),
        row_align=msg.row_align,
        num_pages=msg.num_pages,
        # Only the broker writes pages; readers do not need the used extents.
        page_used=(0,) * msg.num_pages,
        modules=tuple(modules),
        shard=msg.shard,
    )


def shard_msg(s: ModuleShard) -> pb.ModuleShard:
    """A ``ModuleShard`` as its message (``AcquireAdaptersRequest.shards``)."""
    return pb.ModuleShard(module=s.module, split_input=s.split_input, index=s.index, count=s.count)
