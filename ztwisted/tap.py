from twisted.python import usage
from twisted.application import service


class Options(usage.Options):
    optParameters = []


def makeService(config, reactor=None):
    return service.MultiService()
