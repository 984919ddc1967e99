"""What a controller and its members share, torch-free: the typed task and result messages
(:mod:`~pbt.protocol.messages`), atomic files and the heartbeat (:mod:`~pbt.protocol.files`),
the progress a heartbeat carries (:mod:`~pbt.protocol.progress`), member records and ids
(:mod:`~pbt.protocol.records`), faults reported by kind (:mod:`~pbt.protocol.faults`), where a
campaign may write (:mod:`~pbt.protocol.paths`) and the crash points its tests use
(:mod:`~pbt.protocol.crash`).
"""
