"""The built-in drain strategies, as Twisted plugins (IPlugin + IDrainStrategy)."""

from ztwisted.drain.strategies import ClientEvict, GoawayOnStart, Gradual, Immediate, LastMile

immediate = Immediate()
goaway_on_start = GoawayOnStart()
last_mile = LastMile()
client_evict = ClientEvict()
gradual = Gradual()
