"""Twisted finds drain strategies here: any object providing IPlugin and IDrainStrategy."""

from goaway_when_idle import GoawayWhenIdle

goaway_when_idle = GoawayWhenIdle()
