"""octacloud on Kubernetes, both ways: octacloud's scheduler behind kube-scheduler, octants as a device resource,
deployments as custom resources.

- :mod:`~octacloud.k8s.resources`: the wire vocabulary (resource names, labels, annotations) and conversions
  between Kubernetes objects (``v1.Pod``, ``v1.Node`` as JSON) and octacloud's ``Request`` / ``Node``;
- :mod:`~octacloud.k8s.api`: the small Kubernetes API client the parts use (httpx), and an in-memory fake API
  server (an httpx transport) that records every request it receives;
- :mod:`~octacloud.k8s.extender`: kube-scheduler's HTTP extender (filter, prioritize, bind, preempt);
- :mod:`~octacloud.k8s.deviceplugin`: kubelet's device plugin (``v1beta1`` gRPC over unix sockets);
- :mod:`~octacloud.k8s.plugin_server`: serving a device plugin on its socket, registered with kubelet;
- :mod:`~octacloud.k8s.operator`: the ``InferenceDeployment`` custom resource reconciled into pods and a Service
  (kopf runs it in a cluster).

Only this package imports Kubernetes libraries (kopf, kubernetes-validate).
"""
