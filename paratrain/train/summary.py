"""The job-wide numbers of a run's summary, from every worker's end-of-run report.

Throughput is the job's, not rank 0's: all the batches the workers processed,
times the batch size, over the wall time of the training loop. The loops start
together (coordination.py's start barrier), so that wall time is the longest
worker's loop; it includes rank 0's periodic evaluations and checkpoints
(a large ``--eval-every`` leaves them out, as a benchmark should). Under ASP
and SSP the workers share the job's batches unevenly, so each worker's share
is reported beside its compute, its slowdown (slowdown.py) and the time it
waited on communication.
"""
import math


def job_numbers(reports, lost, batch_size, mean_loss=False, ranks_per_batch=1):
    """Summary fields from {rank: report} (coordination.REPORT_FIELDS) and the ranks lost.

    mean_loss: the final loss is the mean of the workers' last losses (parameter
    server, where each worker logs its own batches) rather than left to the caller.
    ranks_per_batch: how many workers take part in each batch (a pipeline's stages
    all count the batches they pass along; it is one batch)."""
    ranks = sorted(reports)
    total = sum(int(reports[r]["batches"]) for r in ranks)
    wall = max((float(reports[r]["loop_s"]) for r in ranks), default=0.0)
    per_worker = []
    for r in ranks:
        rep = reports[r]
        per_worker.append({
            "rank": int(r), "batches": int(rep["batches"]),
            "share": int(rep["batches"]) / total if total else 0.0,
            "compute_s": rep["compute_s"], "slowdown_s": rep["slowdown_s"],
            "slowed_steps": int(rep["slowed_steps"]), "comm_wait_s": rep["comm_wait_s"],
            "loop_s": rep["loop_s"], "last_loss": rep["last_loss"],
            "peak_memory_mb": rep.get("peak_memory_mb"), "peak_rss_mb": rep.get("peak_rss_mb")})
    out = {
        "batches_total": total,
        "samples_per_s": total * batch_size / ranks_per_batch / wall if wall > 0 else 0.0,
        "time_wall_training_s": wall,
        "per_worker": per_worker,
        "peak_memory_mb": max((p["peak_memory_mb"] for p in per_worker if p["peak_memory_mb"] is not None),
                              default=None),
        "peak_rss_mb": max((p["peak_rss_mb"] for p in per_worker if p["peak_rss_mb"] is not None), default=None),
        "lost_workers": list(lost) or None,
    }
    if mean_loss:
        losses = [p["last_loss"] for p in per_worker
                  if isinstance(p["last_loss"], (int, float)) and math.isfinite(p["last_loss"])]
        if losses:
            out["final_loss"] = sum(losses) / len(losses)
    return out
