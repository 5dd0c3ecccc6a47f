"""octacloud — an open-source GPU inference cloud for teams that own bare-metal GPU servers.

The package is layered (see ``docs/architecture.md``): ``core`` is the pure domain, ``scheduler`` places
work on GPUs, ``sim`` replays traces, ``serving`` runs models, ``protocols`` speaks the wire,
``storage`` holds the model repository, ``tenancy`` the tenants and their keys, ``gateway`` routes requests to
replicas, ``control`` runs the fleet (controller, store, launchers), ``admin`` is the operator's web surface, and
``app`` wires it all together.
"""

__version__ = "0.1.0"
