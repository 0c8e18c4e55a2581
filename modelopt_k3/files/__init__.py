"""Files the tools write and the locks they hold: destination guards and never-half-written files
(``paths``), owner records, liveness and every lock (``locks``). Imports nothing else of ``modelopt_k3``."""
