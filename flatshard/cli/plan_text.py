"""`flatshard plan`'s report in words: the planner's figures (planner/estimate.py) as the
lines the command prints, and which activation modes fit a device."""

from __future__ import annotations

from flatshard.planner.estimate import Plan
from flatshard.planner.muon_cost import muon_lines

GIB = 1 << 30


def _size(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:10.3f} GiB"


def _offload_lines(setup, memory) -> list[str]:
    if not setup.offload:
        return []
    share = (
        f"{100 * memory['offloaded_share']:.2f}% of the shards (asked: {100 * setup.offload:g}%)"
    )
    lines = [
        f"    offloaded                       {share}",
        f"      device (peak)                 {_gib(memory['device'])}",
        f"      host                          {_gib(memory['host'])}",
    ]
    if setup.offload_disk:
        lines.append(f"      disk (optimizer state)        {_gib(memory['disk'])}")
    return lines


def what_fits(result: Plan, device_gib: float | None) -> str:
    """The device's peak under each activation mode, and which fit in `device_gib`."""
    peaks = result.device_peak_by_ac
    line = ", ".join(f"{mode} {peaks[mode] / 2**30:.1f}" for mode in peaks)
    out = f"\n  device peak per activation mode (--ac), GiB: {line}"
    if device_gib is not None:
        fits = [mode for mode in peaks if peaks[mode] <= device_gib * 2**30]
        verdict = ", ".join(fits) if fits else "none of them: shard over more ranks"
        out += f"\n  fits in {device_gib:g} GiB: {verdict}"
    return out


def _nf4_line(result: Plan) -> list[str]:
    """QLoRA: the part of the parameters' memory that its NF4 bases take."""
    nf4 = sum(u.nf4 * u.count for u in result.units) // result.setup.dp_shard
    return [f"      of which NF4 bases (QLoRA)    {_gib(nf4)}"] if nf4 else []


def format_plan(result: Plan) -> str:
    s, m, c = result.setup, result.memory, result.communication
    mesh = f"{s.world_size} ranks (dp_shard {s.dp_shard // s.cp}"
    mesh += f", dp_replicate {s.dp_replicate}" if s.dp_replicate > 1 else ""
    mesh += f", tp {s.tp}" + (" + SP" if s.sp else "") if s.tp > 1 else ""
    mesh += f", cp {s.cp}" if s.cp > 1 else ""
    mesh += f", ep {s.ep})" if s.ep > 1 else ")"
    lines = [
        f"flatshard plan: {result.model}, {_size(result.num_params)} parameters, on {mesh}",
        f"  ZeRO-{s.zero_stage} ({s.backend}), {s.param_dtype} compute, {s.reduce_dtype} "
        f"gradient reduction, fp32 weights and {s.optimizer_name} state; micro batch "
        f"{s.micro_batch} x {s.seq_len} tokens, {s.grad_accum} micro-batch(es) per step"
        + (
            f"; each sequence split over {s.cp} ranks ({s.seq_len // s.cp} tokens each), the "
            f"units over dp_shard x cp = {s.dp_shard}"
            if s.cp > 1
            else ""
        ),
        "",
        f"  {'unit (one fully_shard call)':<32}{'params':>10}{'per rank':>11}{'padding':>10}"
        f"{'buckets':>9}",
    ]
    for unit in result.units:
        name = unit.name + (f" (x{unit.count})" if unit.count > 1 else "")
        padding = 100 * unit.padding / unit.numel if unit.numel else 0.0
        lines.append(
            f"  {name:<32}{_size(unit.numel):>10}{_size(unit.shard):>11}{padding:>9.3f}%"
            f"{unit.buckets:>9}"
        )
    largest = max(result.units, key=lambda u: u.padded).name
    lines += [
        "",
        "  per-rank memory",
        f"    parameters (fp32 shards)        {_gib(m['params'])}",
        *_nf4_line(result),
        f"    gradients (fp32 shards)         {_gib(m['grads'])}",
        f"    {'optimizer state (' + s.optimizer_name + ')':<32}{_gib(m['optimizer'])}",
        *(
            [f"    qgZ error feedback (fp32)       {_gib(m['error_feedback'])}"]
            if m["error_feedback"]
            else []
        ),
        f"    largest unsharded unit          {_gib(m['largest_unsharded_unit'])}  ({largest})",
        f"    unsharded working set           {_gib(m['unsharded_working_set'])}",
        f"    {'activations (AC ' + result.setup.ac + ')':<32}{_gib(m['activations'])}",
        f"    total (peak estimate)           {_gib(m['total'])}",
        *_offload_lines(s, m),
        f"    offload_states frees (RL)       {_gib(m['offload_states'])}  (between steps)",
        "",
        f"  padding: {100 * result.padding_fraction:.4f}% of parameter elements",
        "  communication per step, per rank (collective payload)",
        f"    all-gather                      {_gib(c['all_gather'])}"
        + (f"  (weights in {s.quantize_weights})" if s.quantize_weights != "none" else "")
        + (f"  (gradients in {s.quantize_grads})" if s.quantize_grads != "none" else ""),
    ]
    if c["all_gather_in_hpz_groups"]:
        in_groups = _gib(c["all_gather_in_hpz_groups"])
        lines.append(f"      of which in hpZ groups of {s.hpz_group:<4}{in_groups}")
    lines.append(f"    reduce-scatter                  {_gib(c['reduce_scatter'])}")
    if c["replica_all_reduce"]:
        lines.append(f"    replica all-reduce (HSDP)       {_gib(c['replica_all_reduce'])}")
    if c["tp_all_reduce"]:
        lines.append(f"    TP all-reduce (activations)     {_gib(c['tp_all_reduce'])}")
    if c["tp_all_gather"]:
        lines.append(f"    TP all-gather (SP activations)  {_gib(c['tp_all_gather'])}")
        lines.append(f"    TP reduce-scatter (SP)          {_gib(c['tp_reduce_scatter'])}")
    if c["cp_all_gather"]:
        lines.append(f"    CP all-gather (keys, values)    {_gib(c['cp_all_gather'])}")
        if c["cp_all_to_all"]:
            lines.append(f"    CP all-to-all (grads, ring)     {_gib(c['cp_all_to_all'])}")
        else:
            lines.append(f"    CP reduce-scatter (their grads) {_gib(c['cp_reduce_scatter'])}")
    if c["ep_all_to_all"]:
        lines.append(f"    EP all-to-all (tokens)          {_gib(c['ep_all_to_all'])}")
    wire = c["wire_per_rank"] + c["tp_wire_per_rank"] + c["ep_wire_per_rank"]
    wire += c["cp_wire_per_rank"]
    lines.append(f"    on the wire (ring algorithms)   {_gib(wire)}")
    k = result.checkpoint
    total, each = _gib(k["bytes"]).strip(), _gib(k["bytes_per_writer"]).strip()
    lines += [
        "",
        f"  checkpoint: {total} (fp32 weights and {s.optimizer_name} state) in {k['files']:,} "
        f"files: {k['writers']:,} ranks write {each} each, about {k['save_seconds']:.1f} s at "
        f"{s.write_gbps:g} GB/s per rank (--write-gbps)",
    ]
    w = result.weight_sync
    lines.append(
        f"  weight sync (--sync-wire {w['wire']}): {_gib(w['bytes_per_receiver']).strip()} to "
        f"each receiver per full sync, {_gib(w['bytes_per_sender']).strip()} from each of "
        f"{w['senders']:,} ranks (a delta sends only what a step wrote)"
    )
    if result.muon is not None:
        lines += ["", *muon_lines(result.muon)]
    if result.pipeline is not None:
        lines += ["", *_pipeline_lines(result.pipeline, s.pp)]
    return "\n".join(lines)


def _pipeline_lines(pipeline: dict, pp: int) -> list[str]:
    """Each pipeline rank's blocks, in-flight micro-batches, peak and bytes (the memory and
    bytes above are the heaviest rank's)."""
    lines = [
        f"  pipeline: {pp} stages ({pipeline['schedule']}), {pipeline['microbatches']} "
        f"micro-batches a step, bubble {100 * pipeline['bubble_fraction']:.1f}% of the step "
        "(the figures above: the heaviest rank's)",
        "    rank  blocks  in flight      peak  data-parallel bytes  sent to other stages",
    ]
    for stage in pipeline["stages"]:
        c = stage["communication"]
        lines.append(
            f"    {stage['rank']:>4}  {stage['blocks']:>6}  {round(stage['in_flight'], 2):>9g} "
            f"{_gib(stage['memory']['total'])}  {_gib(c['total']):>19}  "
            f"{_gib(c['pipeline_send']):>20}"
        )
    return lines
