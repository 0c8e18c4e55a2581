"""One ``modelopt-k3-ptq`` run: its typed settings and the frozen ``RunPlan`` every stage takes (``plan``), and
the preflight checks that decide it before any weight is read (``preflight``)."""
