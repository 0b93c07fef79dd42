"""The same-host engine: shared-memory segments and blocking semaphores (group.py),
and the algorithms that only make sense in shared memory, built from rounds of
slots and barriers (rounds.py): direct.py, cma.py, resident.py."""
