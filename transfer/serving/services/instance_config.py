"""A `serve` command's options as the `InstanceConfig` its worker instance runs, with the
flags' own checks (named as the flags)."""

from __future__ import annotations

from transfer.serving.engine.serve_options import ServeOptions
from transfer.serving.services.interfaces import interface_of
from transfer.units import parse_size


def instance_config(options: ServeOptions):
    """The instance `options` describe; ValueError names the flag that is out of range."""
    from transfer.presets import load_geometry
    from transfer.serving.engine.instance import InstanceConfig

    if options.lease_seconds <= 0:
        raise ValueError(f"--lease-seconds must be > 0, got {options.lease_seconds}")
    return InstanceConfig(
        role=options.role,
        geometry=load_geometry(options.model),
        model=options.model,
        ssm_dtype=options.ssm_dtype,
        tp=options.tp,
        transport=options.transport,
        device=options.device,
        budget_bytes=parse_size(options.gpu_mem, "--gpu-mem"),
        max_seqs=options.max_seqs,
        max_queue=options.max_queue,
        max_num_batched_tokens=options.max_num_batched_tokens,
        staging_bytes=_staging_bytes(options.staging_mib),
        staging_min_ranges=options.staging_min_ranges,
        staging_min_packed=options.staging_min_packed,
        prefix_cache=options.prefix_cache,
        state_checkpoints=options.state_checkpoints,
        checkpoint_interval=options.checkpoint_interval,
        transfer_mode=options.transfer_mode,
        stream_layers=options.stream_layers,
        min_block_size=options.block_size,
        seed=options.seed,
        dump_dir=options.dump_dir,
        nnodes=options.nnodes,
        node_rank=options.node_rank,
        dist_addr=options.dist_addr,
        net_device=interface_of(
            options.data_host or options.host, "--data-host" if options.data_host else "--host"
        ),
    )


def _staging_bytes(mib: int) -> int:
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
        raise ValueError(f"--staging-mib must be an integer >= 0, got {mib!r}")
    return mib << 20
