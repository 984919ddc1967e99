"""The campaign controller: the generation loop (:mod:`~pbt.controller.campaign`), its budget,
lock and store, the campaign's log to tracking, reports and the progress display. Imports no
torch: members are separate processes, started through :mod:`pbt.launch`; selection, mutation
and search come from :mod:`pbt.evolution`.
"""
