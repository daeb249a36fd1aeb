"""horovod.runner.util.threads.in_thread, which Horovod's test utilities import: run a function on a thread."""
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start `target(*args)` on a new (by default daemon) thread and return the thread.

    silent: swallow an exception of `target` instead of letting the thread report it.
    """
    def run():
        try:
            target(*args)
        except BaseException:  # noqa: BLE001
            if not silent:
                raise

    thread = threading.Thread(target=run if silent else target, args=() if silent else args, name=name,
                              daemon=daemon)
    thread.start()
    return thread
