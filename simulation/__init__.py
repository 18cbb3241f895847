"""simulation package: a discrete-event model of a deployment, built on the real policies."""
