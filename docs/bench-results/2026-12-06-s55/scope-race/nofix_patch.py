"""Negative control: the real code with the pre-start publish switched off (as before the fix)."""
from kalos_retrievers.sidecar import dispatcher as dmod

dmod.Dispatcher._starts_after = lambda self: False
