"""The same-host engine: shared-memory segments and blocking semaphores."""
