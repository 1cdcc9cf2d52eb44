{{/* One worker pool's workload: (dict "ctx" $ "pool" "decode"|"prefill"). A Deployment, or
with lws.enabled and the pool above tensor-parallel size 1 a LeaderWorkerSet: each
worker a group of lws.size pods, tensorParallelSize / lws.size GPUs each, the leader
running the worker (rank 0 and its neighbours), the others `diptych tp-node`. */}}
{{- define "diptych.workerDeployment" -}}
{{- $ := .ctx -}}
{{- $pool := .pool -}}
{{- $v := index $.Values $pool -}}
{{- $tp := int (default 1 $v.tensorParallelSize) -}}
{{- $name := printf "%s-%s" (include "diptych.fullname" $) $pool -}}
{{- $component := dict "ctx" $ "component" $pool -}}
{{- $group := 0 -}}
{{- if and $.Values.lws.enabled (gt $tp 1) -}}
{{- $group = int $.Values.lws.size -}}
{{- if or (lt $group 2) (mod $tp $group) -}}
{{- fail (printf "%s.tensorParallelSize %d does not split over lws.size %d pods (at least 2)" $pool $tp $group) -}}
{{- end -}}
{{- if or (eq $pool "prefill") (and $v.remotePrefill $.Values.prefill.enabled) -}}
{{- fail (printf "lws: a %s worker whose ranks span pods cannot hand KV over yet (only its leader pod's ranks' pools are reachable by transfer): run the pool aggregated (decode.remotePrefill false or prefill.enabled false)" $pool) -}}
{{- end -}}
{{- end -}}
{{- $handsOver := or (eq $pool "prefill") (and $v.remotePrefill $.Values.prefill.enabled) -}}
{{- if and (gt $tp 1) (not $.Values.cpuOnly) $handsOver (eq $group 0) -}}
{{- fail (printf "%s.tensorParallelSize %d on GPUs: a worker above size 1 cannot hand KV over yet (each rank's KV is in its own GPU's memory, which needs a transfer agent a rank): run the pool aggregated (decode.remotePrefill false or prefill.enabled false), or cpuOnly" $pool $tp) -}}
{{- end -}}
{{- if and $.Values.lora.enabled (gt $tp 1) (or (eq $pool "decode") $.Values.prefill.enabled) -}}
{{- fail (printf "lora.enabled: LoRA adapters run at tensor parallel size 1 (%s.tensorParallelSize is %d)" $pool $tp) -}}
{{- end -}}
{{- $kind := ternary "LeaderWorkerSet" "Deployment" (gt $group 0) -}}
{{- $api := ternary "leaderworkerset.x-k8s.io/v1" "apps/v1" (gt $group 0) -}}
apiVersion: {{ $api }}
kind: {{ $kind }}
metadata:
  name: {{ $name }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "diptych.componentLabels" $component | nindent 4 }}
  {{- $identity := include "diptych.identityAnnotations" $ | trim }}
  {{- if or $.Values.rdma.enabled $identity }}
  annotations:
    {{- if $.Values.rdma.enabled }}
    checkov.io/skip1: CKV_K8S_25=UCX pins RDMA memory, which needs IPC_LOCK
    {{- end }}
    {{- with $identity }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  replicas: {{ include "diptych.replicas" (dict "ctx" $ "pool" $pool "live" (lookup $api $kind $.Release.Namespace $name)) }}
  {{- if $group }}
  startupPolicy: LeaderCreated
  rolloutStrategy:
    type: RollingUpdate
    rollingUpdateConfiguration:
      maxUnavailable: 1
      maxSurge: 0
  leaderWorkerTemplate:
    size: {{ $group }}
    # a rank lost is the group lost: every pod of it starts again
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      {{- include "diptych.workerPod" (dict "ctx" $ "pool" $pool "gpus" (div $tp $group) "group" $group) | nindent 6 }}
    workerTemplate:
      {{- include "diptych.rankPod" (dict "ctx" $ "pool" $pool "gpus" (div $tp $group)) | nindent 6 }}
  {{- else }}
  revisionHistoryLimit: 5
  strategy:
    {{- include "diptych.strategy" $v.updateStrategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "diptych.selector" $component | nindent 6 }}
  template:
    {{- include "diptych.workerPod" (dict "ctx" $ "pool" $pool "gpus" $tp "group" 0) | nindent 4 }}
  {{- end }}
{{- end }}

{{/* A worker pool's pod template: (dict "ctx" $ "pool" POOL "gpus" N "group" SIZE), SIZE 0
unless the pod leads a LeaderWorkerSet group of SIZE pods. */}}
{{- define "diptych.workerPod" -}}
{{- $ := .ctx -}}
{{- $pool := .pool -}}
{{- $gpus := .gpus -}}
{{- $group := .group -}}
{{- $v := index $.Values $pool -}}
{{- $tp := int (default 1 $v.tensorParallelSize) -}}
{{- $component := dict "ctx" $ "component" $pool -}}
{{- $model := dict "ctx" $ "m" (include "diptych.workerModel" $ | fromYaml) -}}
metadata:
  labels:
    {{- include "diptych.selector" $component | nindent 4 }}
    app.kubernetes.io/part-of: diptych
  annotations:
    checksum/engine-flags: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
    {{- if and $.Values.rdma.enabled $.Values.rdma.networks }}
    k8s.v1.cni.cncf.io/networks: {{ $.Values.rdma.networks | quote }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- include "diptych.podIdentity" $ | nindent 2 }}
  enableServiceLinks: false
  {{- with (include "diptych.podExtras" $v | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ add $v.drainTimeout $v.preStopSleepSeconds 30 }}
  securityContext:
    {{- include "diptych.podSecurityContext" $ | nindent 4 }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (include "diptych.modelInit" $model | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  containers:
    - name: {{ $pool }}
      image: {{ include "diptych.image" $ | quote }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      args:
        - {{ $pool }}
        - "@/etc/diptych/engine.args"
        - --worker-id=$(POD_NAME)
        - --host=0.0.0.0
        - --advertise-host=$(POD_IP)
        - --port={{ $v.grpcPort }}
        - --metrics-port={{ $v.metricsPort }}
        {{- include "diptych.controlPlaneArgs" $ | nindent 8 }}
        - --nats={{ include "diptych.nats" $ }}
        - --transfer={{ include "diptych.transferBackend" $ }}
        - --drain-timeout={{ $v.drainTimeout }}
        {{- if gt $tp 1 }}
        - --tensor-parallel-size={{ $tp }}
        {{- end }}
        {{- if $group }}
        - --tensor-parallel-nodes={{ $group }}
        - --tensor-parallel-leader=$(LWS_LEADER_ADDRESS):{{ $.Values.lws.port }}
        {{- end }}
        {{- with (include "diptych.modelArgs" $model | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if eq $pool "decode" }}
        {{- with (include "diptych.servedModelArgs" $ | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- if and (eq $pool "decode") (or (not $v.remotePrefill) (not $.Values.prefill.enabled)) }}
        - --no-remote-prefill
        {{- end }}
        {{- with (include "diptych.flagArgs" $v.flags | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        {{- include "diptych.podEnv" $ | nindent 8 }}
        {{- if $group }}
        - name: DIPTYCH_TP_HOST  # the address the group's other pods reach this rank at
          value: $(POD_IP)
        {{- end }}
        {{- if not $.Values.cpuOnly }}
        {{- $env := $.Values.transfer.env }}
        {{- if $.Values.rdma.enabled }}{{ $env = merge (deepCopy $.Values.rdma.env) $.Values.transfer.env }}{{ end }}
        {{- range $k, $val := $env }}
        {{- if $val }}
        - name: {{ $k }}
          value: {{ $val | quote }}
        {{- end }}
        {{- end }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.grpcPort }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $v.metricsPort }}
          protocol: TCP
        {{- if $group }}
        - name: tp-store  # where the group's other pods meet rank 0
          containerPort: {{ $.Values.lws.port }}
          protocol: TCP
        {{- end }}
      startupProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 10
        failureThreshold: {{ mul $v.startupMinutes 6 }}
      livenessProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 3
      readinessProbe:
        httpGet:
          path: /ready
          port: metrics
        periodSeconds: 5
        timeoutSeconds: 3
        failureThreshold: 2
      lifecycle:
        preStop:
          exec:
            command: ["sleep", "{{ $v.preStopSleepSeconds }}"]
      resources:
        {{- $res := deepCopy $v.resources }}
        {{- if $.Values.cpuOnly }}
        {{- $_ := unset (default dict $res.requests) "nvidia.com/gpu" }}
        {{- $_ := unset (default dict $res.limits) "nvidia.com/gpu" }}
        {{- else }}
        {{- /* one GPU a rank of this pod: set, not added to what `resources` says */}}
        {{- $_ := set $res "requests" (set (default dict $res.requests) "nvidia.com/gpu" $gpus) }}
        {{- $_ := set $res "limits" (set (default dict $res.limits) "nvidia.com/gpu" $gpus) }}
        {{- end }}
        {{- if $.Values.rdma.enabled }}
        {{- $r := $.Values.rdma.resource }}
        {{- $device := dict (required "rdma.resource.name is required with rdma.enabled" $r.name) (int $r.count) }}
        {{- $_ := set $res "requests" (merge (default dict $res.requests) $device) }}
        {{- $_ := set $res "limits" (merge (default dict $res.limits) $device) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- $sc := deepCopy $.Values.securityContext }}
        {{- if $.Values.rdma.enabled }}
        {{- $_ := set $sc "capabilities" (dict "drop" (list "ALL") "add" (list "IPC_LOCK")) }}
        {{- end }}
        {{- toYaml $sc | nindent 8 }}
      volumeMounts:
        - name: engine-flags
          mountPath: /etc/diptych
          readOnly: true
        - name: dshm
          mountPath: /dev/shm
        {{- include "diptych.scratchMounts" $ | nindent 8 }}
        {{- with (include "diptych.modelMount" $model | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with (include "diptych.loraMount" $ | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: engine-flags
      configMap:
        name: {{ include "diptych.fullname" $ }}-engine
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSize }}
    {{- include "diptych.scratchVolumes" $ | nindent 4 }}
    {{- with (include "diptych.modelVolume" $model | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with (include "diptych.loraVolume" $ | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and (not $.Values.cpuOnly) $v.tolerations }}
  tolerations:
    {{- toYaml $v.tolerations | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The pod template of a LeaderWorkerSet group's other pods: (dict "ctx" $ "pool" POOL
"gpus" N). `diptych tp-node` runs this pod's ranks, which meet rank 0 at the leader's
address (LWS_LEADER_ADDRESS and LWS_WORKER_INDEX come from the LWS controller) and
exit when the worker ends the group; they load the same model and take no traffic. */}}
{{- define "diptych.rankPod" -}}
{{- $ := .ctx -}}
{{- $pool := .pool -}}
{{- $v := index $.Values $pool -}}
{{- $component := dict "ctx" $ "component" (printf "%s-ranks" $pool) -}}
{{- $model := dict "ctx" $ "m" (include "diptych.workerModel" $ | fromYaml) -}}
metadata:
  labels:
    {{- include "diptych.selector" $component | nindent 4 }}
    app.kubernetes.io/part-of: diptych
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "diptych.podIdentity" $ | nindent 2 }}
  enableServiceLinks: false
  {{- with (include "diptych.podExtras" $v | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  terminationGracePeriodSeconds: 30
  securityContext:
    {{- include "diptych.podSecurityContext" $ | nindent 4 }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (include "diptych.modelInit" $model | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  containers:
    - name: {{ $pool }}-ranks
      image: {{ include "diptych.image" $ | quote }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      args:
        - tp-node
        - --leader=$(LWS_LEADER_ADDRESS):{{ $.Values.lws.port }}
        - --node=$(LWS_WORKER_INDEX)
      env:  # no control-plane credentials: these ranks talk to their group only
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        - name: DIPTYCH_TP_HOST  # the address the group's other pods reach these ranks at
          value: $(POD_IP)
        - name: DIPTYCH_CACHE_DIR
          value: /home/diptych/.cache/diptych
        - name: TRITON_CACHE_DIR
          value: /home/diptych/.cache/triton
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- $res := deepCopy $v.resources }}
        {{- if $.Values.cpuOnly }}
        {{- $_ := unset (default dict $res.requests) "nvidia.com/gpu" }}
        {{- $_ := unset (default dict $res.limits) "nvidia.com/gpu" }}
        {{- else }}
        {{- $_ := set $res "requests" (set (default dict $res.requests) "nvidia.com/gpu" .gpus) }}
        {{- $_ := set $res "limits" (set (default dict $res.limits) "nvidia.com/gpu" .gpus) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- toYaml $.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        - name: cache
          mountPath: /home/diptych/.cache
        {{- with (include "diptych.modelMount" $model | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSize }}
    - name: tmp
      emptyDir: {}
    - name: cache
      emptyDir: {}
    {{- with (include "diptych.modelVolume" $model | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and (not $.Values.cpuOnly) $v.tolerations }}
  tolerations:
    {{- toYaml $v.tolerations | nindent 4 }}
  {{- end }}
{{- end }}

{{/* A pool's headless Service (metrics scrapes, DNS of its pods) and PDB. */}}
{{- define "diptych.workerExtras" -}}
{{- $ := .ctx -}}
{{- $pool := .pool -}}
{{- $v := index $.Values $pool -}}
{{- $component := dict "ctx" $ "component" $pool -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "diptych.fullname" $ }}-{{ $pool }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "diptych.componentLabels" $component | nindent 4 }}
    diptych.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "diptych.selector" $component | nindent 4 }}
  ports:
    - name: metrics
      port: {{ $v.metricsPort }}
      targetPort: metrics
{{- if $v.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "diptych.fullname" $ }}-{{ $pool }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "diptych.componentLabels" $component | nindent 4 }}
spec:
  maxUnavailable: {{ $v.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "diptych.selector" $component | nindent 6 }}
{{- end }}
{{- end }}

{{/* A pool's spec.replicas: the values' replicas, except that with the planner on, a pool
that already runs keeps its live size (Helm's lookup of the Deployment), so no upgrade
undoes the planner's sizing, the upgrade that turns it on included. Always written: a
Deployment without the field is one pod, and an upgrade that drops it sends null.
(dict "ctx" $ "pool" "decode" "live" LOOKUP); LOOKUP is empty at install and offline. */}}
{{- define "diptych.replicas" -}}
{{- $n := index .ctx.Values .pool "replicas" -}}
{{- if .ctx.Values.planner.enabled -}}
{{- $spec := (default dict .live).spec -}}
{{- if and $spec (hasKey $spec "replicas") -}}
{{- $n = $spec.replicas -}}
{{- end -}}
{{- end -}}
{{ int $n }}
{{- end }}
