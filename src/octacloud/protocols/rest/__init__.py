"""REST front end: the Open Inference Protocol over HTTP, as an ASGI app."""

from octacloud.protocols.rest.app import RestApp

__all__ = ["RestApp"]
