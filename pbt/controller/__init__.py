"""The campaign controller: generations, the store, launchers, selection, mutation, search,
tracking and reports. Imports no torch: members are separate processes.
"""
