"""Ending the processes a timing forks (neighbours, stand-in ranks, a server, two stages)."""


def end(processes, grace_s):
    """Wait up to ``grace_s`` seconds for each of ``processes`` to exit, then kill those still
    running and reap them: a timing that failed or finished leaves nothing behind."""
    for p in processes:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()
