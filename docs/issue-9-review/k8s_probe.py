"""Probe: what SkyPilot 0.14.1 decides for a recipe on a fake AMD Kubernetes cluster (no network)."""
import sys
from unittest import mock
import sky
from sky import clouds
from sky.provision.kubernetes import utils as ku

LABEL, EPHEMERAL, YAML = sys.argv[1], sys.argv[2], sys.argv[3]
def node(name):
    return ku.V1Node.from_dict({'metadata': {'name': name, 'labels': {'skypilot.co/accelerator': LABEL}},
        'status': {'capacity': {'cpu': '160', 'memory': '1981633424Ki', 'amd.com/gpu': '8', 'ephemeral-storage': EPHEMERAL},
                   'allocatable': {'cpu': '158', 'memory': '1900000000Ki', 'amd.com/gpu': '8', 'ephemeral-storage': EPHEMERAL},
                   'conditions': [{'type': 'Ready', 'status': 'True'}]}})
NODES = [node('n0'), node('n1')]
ku.get_gpu_resource_key = lambda *a, **k: 'amd.com/gpu'
ku._gpu_resource_key_helper = lambda *a, **k: 'amd.com/gpu'
for p in [mock.patch.object(ku, 'get_kubernetes_nodes', lambda *a, **k: NODES),
          mock.patch.object(ku, 'get_current_kube_config_context_name', lambda: 'amd-ctx'),
          mock.patch.object(clouds.Kubernetes, 'existing_allowed_contexts', classmethod(lambda cls, silent=False: ['amd-ctx']))]:
    p.start()
task = sky.Task.from_yaml(YAML)
k8s = clouds.Kubernetes()
for r in sorted(task.resources, key=str):
    if not isinstance(r.cloud, clouds.Kubernetes):
        continue
    try:
        feas = k8s._get_feasible_launchable_resources(r)
        its = [x.instance_type for x in feas.resources_list]
        print(dict(r.accelerators), 'disk_specified', r.disk_size_specified, '->', its or 'NOT FEASIBLE', feas.hint or '')
        for it in its[:1]:
            print('   label', ku.get_accelerator_label_key_values('amd-ctx', list(r.accelerators)[0], 8)[:2])
    except Exception as e:
        print(dict(r.accelerators), 'ERROR', type(e).__name__, str(e)[:200])

# deploy variables (what goes into the pod spec) for the first feasible candidate
from sky.utils import resources_utils
for r in sorted(task.resources, key=str):
    if not isinstance(r.cloud, clouds.Kubernetes):
        continue
    feas = k8s._get_feasible_launchable_resources(r)
    if not feas.resources_list:
        continue
    lr = feas.resources_list[0].copy(region='amd-ctx')
    try:
        v = k8s.make_deploy_resources_variables(lr, resources_utils.ClusterName('c', 'c-abcd'),
                                                clouds.Region('amd-ctx'), None, 2, dryrun=True)
        keys = ['cpus', 'memory', 'accelerator_count', 'k8s_resource_key', 'k8s_acc_label_key', 'k8s_acc_label_values',
                'k8s_ephemeral_storage', 'image_id', 'k8s_spot_label_key', 'k8s_host_network']
        print('DEPLOY', {k: v.get(k) for k in keys})
    except Exception as e:
        import traceback; traceback.print_exc(limit=-3)
    break
