"""Preloaded by the fork server in test_starting_until_the_pool_is_ready: a slow framework import."""

import time

time.sleep(3)
