"""Ignores SIGTERM, SIGINT and SIGHUP, then sleeps in its call for ever: an evaluator that asked its
worker to stop politely would wait on it without end."""
import signal
import time

for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)


def custom_kernel(inputs):
    while True:
        time.sleep(3600)
