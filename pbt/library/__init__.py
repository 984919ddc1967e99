"""Library mode: populations in your own process, on one shared base model.

:func:`create_population` builds one from ``INIT_HP``; :class:`Population` and :class:`Agent`
are driven from your loop, or by :func:`train_population`.
"""
