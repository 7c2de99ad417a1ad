import threading

import pytest

from mmpack_udfs.io.ahead import read_ahead


def test_items_come_in_order_and_all_of_them():
    assert list(read_ahead(iter(range(5)))) == [0, 1, 2, 3, 4]
    assert list(read_ahead([])) == []


def test_the_next_item_is_made_while_this_one_is_used():
    used = threading.Event()

    def items():
        yield "first"
        # made only while the caller holds "first": without a thread this would wait forever
        if not used.wait(timeout=30):
            raise AssertionError("the second item was not made while the first was in use")
        yield "second"

    ahead = read_ahead(items())
    assert next(ahead) == "first"
    used.set()
    assert next(ahead) == "second"


def test_an_error_making_an_item_is_raised_where_that_item_would_come():
    def items():
        yield 1
        raise ValueError("bad part")

    ahead = read_ahead(items())
    assert next(ahead) == 1
    with pytest.raises(ValueError, match="bad part"):
        next(ahead)
