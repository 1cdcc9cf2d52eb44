{{/* One worker pool's Deployment: (dict "ctx" $ "pool" "decode"|"prefill") */}}
{{- define "diptych.workerDeployment" -}}
{{- $ := .ctx -}}
{{- $pool := .pool -}}
{{- $v := index $.Values $pool -}}
{{- $tp := int (default 1 $v.tensorParallelSize) -}}
{{- $name := printf "%s-%s" (include "diptych.fullname" $) $pool -}}
{{- $component := dict "ctx" $ "component" $pool -}}
{{- $model := dict "ctx" $ "m" (include "diptych.workerModel" $ | fromYaml) -}}
apiVersion: apps/v1
kind: Deployment
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
  replicas: {{ include "diptych.replicas" (dict "ctx" $ "pool" $pool "live" (lookup "apps/v1" "Deployment" $.Release.Namespace $name)) }}
  revisionHistoryLimit: 5
  strategy:
    {{- include "diptych.strategy" $v.updateStrategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "diptych.selector" $component | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "diptych.selector" $component | nindent 8 }}
        app.kubernetes.io/part-of: diptych
      annotations:
        checksum/engine-flags: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
        {{- if and $.Values.rdma.enabled $.Values.rdma.networks }}
        k8s.v1.cni.cncf.io/networks: {{ $.Values.rdma.networks | quote }}
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "diptych.podIdentity" $ | nindent 6 }}
      enableServiceLinks: false
      {{- with (include "diptych.podExtras" $v | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ add $v.drainTimeout $v.preStopSleepSeconds 30 }}
      securityContext:
        {{- include "diptych.podSecurityContext" $ | nindent 8 }}
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "diptych.modelInit" $model | trim) }}
      {{- . | nindent 6 }}
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
            {{- include "diptych.controlPlaneArgs" $ | nindent 12 }}
            - --nats={{ include "diptych.nats" $ }}
            - --transfer={{ include "diptych.transferBackend" $ }}
            - --drain-timeout={{ $v.drainTimeout }}
            {{- if gt $tp 1 }}
            - --tensor-parallel-size={{ $tp }}
            {{- end }}
            {{- with (include "diptych.modelArgs" $model | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if eq $pool "decode" }}
            {{- with (include "diptych.servedModelArgs" $ | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- end }}
            {{- if and (eq $pool "decode") (or (not $v.remotePrefill) (not $.Values.prefill.enabled)) }}
            - --no-remote-prefill
            {{- end }}
            {{- with (include "diptych.flagArgs" $v.flags | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- include "diptych.podEnv" $ | nindent 12 }}
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
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.grpcPort }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
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
            {{- /* one GPU a rank: set, not added to what `resources` says */}}
            {{- $_ := set $res "requests" (set (default dict $res.requests) "nvidia.com/gpu" $tp) }}
            {{- $_ := set $res "limits" (set (default dict $res.limits) "nvidia.com/gpu" $tp) }}
            {{- end }}
            {{- if $.Values.rdma.enabled }}
            {{- $r := $.Values.rdma.resource }}
            {{- $device := dict (required "rdma.resource.name is required with rdma.enabled" $r.name) (int $r.count) }}
            {{- $_ := set $res "requests" (merge (default dict $res.requests) $device) }}
            {{- $_ := set $res "limits" (merge (default dict $res.limits) $device) }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- $sc := deepCopy $.Values.securityContext }}
            {{- if $.Values.rdma.enabled }}
            {{- $_ := set $sc "capabilities" (dict "drop" (list "ALL") "add" (list "IPC_LOCK")) }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          volumeMounts:
            - name: engine-flags
              mountPath: /etc/diptych
              readOnly: true
            - name: dshm
              mountPath: /dev/shm
            {{- include "diptych.scratchMounts" $ | nindent 12 }}
            {{- with (include "diptych.modelMount" $model | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: engine-flags
          configMap:
            name: {{ include "diptych.fullname" $ }}-engine
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize }}
        {{- include "diptych.scratchVolumes" $ | nindent 8 }}
        {{- with (include "diptych.modelVolume" $model | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if and (not $.Values.cpuOnly) $v.tolerations }}
      tolerations:
        {{- toYaml $v.tolerations | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
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
