"""Every rank's layout of one instance, for packer tests."""

from __future__ import annotations

from transfer.cache import Layout, LayoutOptions


def instance_layouts(
    geometry, tp: int, block_size: int, num_blocks: int, num_slots: int,
    staging: int = 1 << 20, **options,
) -> tuple[Layout, ...]:  # fmt: skip
    """The `tp` ranks' layouts; `options` are `LayoutOptions` fields."""
    layout = Layout(geometry, tp, 0, block_size, num_blocks, num_slots,
                    options=LayoutOptions(**options), staging_bytes=staging)  # fmt: skip
    return layout.all_ranks()
