"""The client library: sessions with a memory broker and zero-copy access to its pages."""

from clients.client import BrokerClient, BrokerObject, Spec, Transaction
from broker.errors import BrokerError, Code

__all__ = ["BrokerClient", "BrokerObject", "Spec", "Transaction", "BrokerError", "Code"]
