{{/* Names, labels and the pieces every Diptych container shares. */}}

{{- define "diptych.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "diptych.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "diptych.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "diptych.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "diptych.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "diptych.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: diptych
{{- end }}

{{/* selector labels of one component: (dict "ctx" $ "component" "decode") */}}
{{- define "diptych.selector" -}}
app.kubernetes.io/name: {{ include "diptych.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "diptych.componentLabels" -}}
{{ include "diptych.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "diptych.image" -}}
{{- $img := .Values.image -}}
{{- if $img.digest -}}
{{ $img.repository }}@{{ $img.digest }}
{{- else -}}
{{ $img.repository }}:{{ $img.tag }}
{{- end -}}
{{- end }}

{{/* The control plane every role dials. */}}
{{- define "diptych.etcd" -}}
{{- if .Values.etcd.enabled -}}
{{ include "diptych.fullname" . }}-etcd:2379
{{- else -}}
{{ required "etcd.external.endpoints is required when etcd.enabled is false" .Values.etcd.external.endpoints }}
{{- end -}}
{{- end }}

{{- define "diptych.nats" -}}
{{- if .Values.nats.enabled -}}
{{ include "diptych.fullname" . }}-nats:4222
{{- else -}}
{{ required "nats.external.url is required when nats.enabled is false" .Values.nats.external.url }}
{{- end -}}
{{- end }}

{{- define "diptych.controlPlaneArgs" -}}
{{- if eq .Values.discovery.backend "kubernetes" }}
- --discovery=kubernetes://{{ .Release.Namespace }}
{{- else }}
- --etcd={{ include "diptych.etcd" . }}
{{- end }}
- --namespace={{ .Release.Name }}
{{- end }}

{{- define "diptych.k8sDiscovery" -}}
{{- eq .Values.discovery.backend "kubernetes" -}}
{{- end }}

{{/* The pod's identity: the fleet's ServiceAccount under Kubernetes discovery (its
Role reads and writes Leases), else none at all. */}}
{{- define "diptych.podIdentity" -}}
{{- if eq .Values.discovery.backend "kubernetes" }}
serviceAccountName: {{ include "diptych.fullname" . }}-fleet
automountServiceAccountToken: true
{{- else }}
automountServiceAccountToken: false
{{- end }}
{{- end }}

{{- define "diptych.identityAnnotations" -}}
{{- if eq .Values.discovery.backend "kubernetes" }}
checkov.io/skip2: CKV_K8S_38=Kubernetes discovery authenticates with this token
{{- end }}
{{- end }}

{{/* --model for any role. */}}
{{- define "diptych.modelArgs" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "builtin" }}
- --model=/models/{{ required "model.path is required unless model.source is builtin" $m.path }}
{{- end }}
{{- end }}

{{/* --served-model-name for the roles that name the model (frontend, decode). */}}
{{- define "diptych.servedModelArgs" -}}
{{- with .Values.model.servedModelName }}
- --served-model-name={{ . }}
{{- end }}
{{- end }}

{{/* flags map -> --key=value args (true: bare switch; false/null: left out) */}}
{{- define "diptych.flagArgs" -}}
{{- range $k, $v := . }}
{{- if kindIs "bool" $v }}
{{- if $v }}
- --{{ $k }}
{{- end }}
{{- else if not (kindIs "invalid" $v) }}
- --{{ $k }}={{ $v }}
{{- end }}
{{- end }}
{{- end }}

{{- define "diptych.engineFlags" -}}
{{- $flags := deepCopy .Values.engine.flags -}}
{{- if .Values.cpuOnly }}{{ $_ := set $flags "device" "cpu" }}{{ end -}}
{{- range $k, $v := $flags }}
{{- if kindIs "bool" $v }}
{{- if $v }}
--{{ $k }}
{{- end }}
{{- else if not (kindIs "invalid" $v) }}
--{{ $k }} {{ $v }}
{{- end }}
{{- end }}
{{- end }}

{{- define "diptych.transferBackend" -}}
{{- if .Values.cpuOnly -}}tcp{{- else -}}{{ .Values.transfer.backend }}{{- end -}}
{{- end }}

{{- define "diptych.podSecurityContext" -}}
{{ toYaml .Values.podSecurityContext }}
{{- end }}

{{- define "diptych.securityContext" -}}
{{ toYaml .Values.securityContext }}
{{- end }}

{{/* Volumes holding the model, per model.source. */}}
{{- define "diptych.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required for model.source pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required for model.source hostPath" $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "image" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.image.sizeLimit }}
{{- end }}
{{- end }}

{{- define "diptych.modelMount" -}}
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: /models
  readOnly: {{ ne .Values.model.source "image" }}
{{- end }}
{{- end }}

{{/* The init container that copies an image-packaged model into the pod. */}}
{{- define "diptych.modelInit" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" }}
initContainers:
  - name: model
    image: "{{ required "model.image.repository is required for model.source image" $m.image.repository }}:{{ required "model.image.tag is required for model.source image" $m.image.tag }}"
    imagePullPolicy: IfNotPresent
    command: ["cp", "-a", "{{ $m.image.path }}/.", "/models/"]
    securityContext:
      {{- include "diptych.securityContext" . | nindent 6 }}
    resources:
      requests: {cpu: 500m, memory: 256Mi, ephemeral-storage: 1Gi}
      limits: {cpu: "2", memory: 1Gi, ephemeral-storage: 1Gi}
    volumeMounts:
      - name: model
        mountPath: /models
{{- end }}
{{- end }}

{{/* Writable scratch for a read-only root filesystem: /tmp and the caches. */}}
{{- define "diptych.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- with .Values.clusterSecret.name }}
- name: cluster-secret
  secret:
    secretName: {{ . | quote }}
    defaultMode: 0400
{{- end }}
{{- end }}

{{- define "diptych.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/diptych/.cache
{{- if .Values.clusterSecret.name }}
- name: cluster-secret
  mountPath: /etc/diptych/cluster-secret
  readOnly: true
{{- end }}
{{- end }}

{{- define "diptych.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- /* the image's prebuilt kernels are read-only; caches go to the "cache" emptyDir */}}
- name: DIPTYCH_CACHE_DIR
  value: /home/diptych/.cache/diptych
- name: TRITON_CACHE_DIR
  value: /home/diptych/.cache/triton
{{- if .Values.clusterSecret.name }}
- name: DIPTYCH_CLUSTER_SECRET_FILE
  value: /etc/diptych/cluster-secret/{{ .Values.clusterSecret.key }}
{{- end }}
{{- end }}
