"""Example plugins for turnrl (see docs/plugins.md): import them by path, e.g.
`env.name: 'examples.guess.env:ENV'`."""
