"""The client library: sessions with a memory broker and zero-copy access to its pages."""

from clients.adapters import AdapterLease, AdapterTables, LeasedAdapter
from clients.client import BrokerClient, BrokerObject, Spec, Transaction
from broker.errors import BrokerError, Code

__all__ = [
    "AdapterLease",
    "AdapterTables",
    "BrokerClient",
    "BrokerError",
    "BrokerObject",
    "Code",
    "LeasedAdapter",
    "Spec",
    "Transaction",
]
