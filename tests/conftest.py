import pytest


def pytest_collection_modifyitems(config, items):
    # Runtime tests share one SGLang start-up per session; run them after the fast tier.
    items.sort(key=lambda item: item.get_closest_marker("runtime") is not None)
