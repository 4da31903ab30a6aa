"""Where a job's processes meet for gloo: kspipe's address book (kspipe/cluster/addresses.py,
kspipe/cluster/meeting.py).  Every cluster test meets through it; these check the book."""

import socket
import urllib.error
import urllib.request

import pytest

from kspipe.cluster.endpoints import free_ports
from kspipe.cluster.meeting import open_book
from kspipe.errors import ClusterError


def test_the_book_keeps_what_is_put_and_ends_with_its_starter():
    (port,) = free_ports(1)
    book = open_book("127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}/worker/rank-1"
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url)
        assert missing.value.code == 404
        put = urllib.request.Request(url, data=b"\x00address", method="PUT")
        assert urllib.request.urlopen(put).status == 200
        assert urllib.request.urlopen(url).read() == b"\x00address"
        with pytest.raises(urllib.error.HTTPError):  # another world's key is another key
            urllib.request.urlopen(f"http://127.0.0.1:{port}/server/rank-1")
    finally:
        book.stdin.close()  # what the starter's exit does
    assert book.wait(timeout=10) == 0


def test_a_taken_port_is_one_line():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"could not take port {port}"):
            open_book("127.0.0.1", port)


def test_the_book_listens_on_the_jobs_address_alone():
    """Given an address this machine holds, the book takes its port there, not on every
    interface: 127.0.0.2, another of this machine's loopback addresses, is refused."""
    (port,) = free_ports(1)
    book = open_book("127.0.0.1", port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=5):
            pass
    finally:
        book.stdin.close()
    assert book.wait(timeout=10) == 0
