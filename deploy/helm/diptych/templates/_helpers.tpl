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

{{/* The control plane every role dials: the bundled NATS and etcd over TLS with the
chart's client certificate (and NATS's password), or your own by URL. */}}
{{- define "diptych.clientDir" -}}/etc/diptych/control-plane{{- end }}

{{- define "diptych.clientCert" -}}
{{- $d := include "diptych.clientDir" . -}}
ca={{ $d }}/ca.crt&cert={{ $d }}/tls.crt&key={{ $d }}/tls.key
{{- end }}

{{- define "diptych.bundledEtcd" -}}
{{- and .Values.etcd.enabled (eq .Values.discovery.backend "etcd") -}}
{{- end }}

{{/* whether the chart makes a CA and certificates (the bundled brokers want them) */}}
{{- define "diptych.controlPlanePki" -}}
{{- $nats := and .Values.nats.enabled (or .Values.nats.tls.enabled .Values.nats.auth.enabled) -}}
{{- $etcd := and (eq (include "diptych.bundledEtcd" .) "true") .Values.etcd.tls.enabled -}}
{{- or $nats $etcd .Values.grpcTls.enabled -}}
{{- end }}

{{- define "diptych.etcd" -}}
{{- if .Values.etcd.enabled -}}
{{- if .Values.etcd.tls.enabled -}}
etcds://{{ include "diptych.fullname" . }}-etcd:2379?{{ include "diptych.clientCert" . }}
{{- else -}}
{{ include "diptych.fullname" . }}-etcd:2379
{{- end -}}
{{- else -}}
{{ required "etcd.external.endpoints is required when etcd.enabled is false" .Values.etcd.external.endpoints }}
{{- end -}}
{{- end }}

{{- define "diptych.nats" -}}
{{- $v := .Values.nats -}}
{{- if $v.enabled -}}
{{- $host := printf "%s-nats:4222" (include "diptych.fullname" .) -}}
{{- $query := list -}}
{{- if $v.tls.enabled }}{{ $query = append $query (include "diptych.clientCert" .) }}{{ end -}}
{{- if $v.auth.enabled }}{{ $query = append $query (printf "password_file=%s/nats-password" (include "diptych.clientDir" .)) }}{{ end -}}
{{ ternary "tls" "nats" $v.tls.enabled }}://{{ if $v.auth.enabled }}diptych@{{ end }}{{ $host }}{{ if $query }}?{{ join "&" $query }}{{ end }}
{{- else -}}
{{ required "nats.external.url is required when nats.enabled is false" $v.external.url }}
{{- end -}}
{{- end }}

{{/* The bundled NATS's configuration: JetStream, TLS that requires a client certificate
the chart's CA signed, and one user whose password is kept only as a bcrypt hash.
(dict "ctx" $ "password" PASSWORD) */}}
{{- define "diptych.natsConfig" -}}
{{- $v := .ctx.Values.nats -}}
port: 4222
http_port: 8222
server_name: $POD_NAME
jetstream {
  store_dir: /data
}
{{- if $v.tls.enabled }}
tls {
  cert_file: /etc/nats/tls/tls.crt
  key_file: /etc/nats/tls/tls.key
  ca_file: /etc/nats/tls/ca.crt
  verify: true
  timeout: 5
}
{{- end }}
{{- if $v.auth.enabled }}
authorization {
  user: diptych
  password: "{{ bcrypt .password }}"
}
{{- end }}
{{- end }}

{{- define "diptych.clusterSecretName" -}}
{{- if .Values.clusterSecret.name -}}
{{ .Values.clusterSecret.name }}
{{- else if .Values.clusterSecret.create -}}
{{ include "diptych.fullname" . }}-cluster
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

{{/* --model for any role: (dict "ctx" $ "m" SOURCE), SOURCE being model or what
diptych.frontendModel makes of frontend.tokenizer. */}}
{{- define "diptych.modelArgs" -}}
{{- if ne .m.source "builtin" }}
- --model=/models/{{ required "model.path is required unless model.source is builtin" .m.path }}
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
{{- with .Values.lora }}{{ if .enabled }}
{{- $_ := set $flags "enable-lora" true -}}
{{- $_ := set $flags "max-loras" (int .maxLoras) -}}
{{- $_ := set $flags "max-lora-rank" (int .maxLoraRank) -}}
{{- if .maxCpuLoras }}{{ $_ := set $flags "max-cpu-loras" (int .maxCpuLoras) }}{{ end -}}
{{- end }}{{ end -}}
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

{{/* Where the frontend reads the tokenizer and chat template (it loads no weights), as a
model source (toYaml; fromYaml it): frontend.tokenizer's own source, else the model's.
A hostPath model is on the GPU nodes, not where the frontends run: it takes a source of
the frontend's own. tokenizerOnly: an image source copies the tokenizer files alone. */}}
{{- define "diptych.frontendModel" -}}
{{- $m := .Values.model -}}
{{- $t := .Values.frontend.tokenizer -}}
{{- $src := dict -}}
{{- if $t.source -}}
{{- $pvc := dict "claimName" (default $m.pvc.claimName $t.pvc.claimName) -}}
{{- $host := dict "path" (default $m.hostPath.path $t.hostPath.path) -}}
{{- $img := dict "repository" (default $m.image.repository $t.image.repository) "tag" (default $m.image.tag $t.image.tag) "path" (default $m.image.path $t.image.path) -}}
{{- $src = dict "source" $t.source "path" (default $m.path $t.path) "pvc" $pvc "hostPath" $host "image" $img -}}
{{- else if eq $m.source "hostPath" -}}
{{- fail "model.source hostPath: the frontends (often on CPU nodes, where the GPU nodes' directory need not exist) read the tokenizer from a source of their own: set frontend.tokenizer.source (image or pvc holding the tokenizer files, or hostPath if the directory is on the frontends' nodes too)" -}}
{{- else -}}
{{- $src = pick $m "source" "path" "pvc" "hostPath" "image" -}}
{{- end -}}
{{- $size := $t.sizeLimit -}}
{{- if and (not $t.source) (hasSuffix ".gguf" $m.path) }}{{ $size = $m.image.sizeLimit }}{{ end -}}
{{- $_ := set $src "sizeLimit" $size -}}
{{- $_ := set $src "tokenizerOnly" true -}}
{{- toYaml $src -}}
{{- end }}

{{/* The workers' model source: the model, copied whole. */}}
{{- define "diptych.workerModel" -}}
{{- $src := pick .Values.model "source" "path" "pvc" "hostPath" "image" -}}
{{- $_ := set $src "sizeLimit" .Values.model.image.sizeLimit -}}
{{- $_ := set $src "tokenizerOnly" false -}}
{{- toYaml $src -}}
{{- end }}

{{/* Volumes holding the model, per source: (dict "ctx" $ "m" SOURCE) */}}
{{- define "diptych.modelVolume" -}}
{{- $m := .m -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "a claimName is required for source pvc (model.pvc, frontend.tokenizer.pvc)" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "a path is required for source hostPath (model.hostPath, frontend.tokenizer.hostPath)" $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "image" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.sizeLimit }}
{{- end }}
{{- end }}

{{/* The LoRA adapters' volume and its mount in the worker pods (lora.enabled) */}}
{{- define "diptych.loraVolume" -}}
{{- with .Values.lora }}{{ if .enabled }}
- name: lora-adapters
{{- if eq .source "image" }}
  image:
    reference: {{ required "lora.image.reference is required for lora.source image" .image.reference | quote }}
    pullPolicy: {{ .image.pullPolicy }}
{{- else if eq .source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "lora.pvc.claimName is required for lora.source pvc" .pvc.claimName | quote }}
    readOnly: true
{{- else }}
{{- fail (printf "lora.source must be pvc or image, got %q" .source) }}
{{- end }}
{{- end }}{{ end }}
{{- end }}

{{- define "diptych.loraMount" -}}
{{- with .Values.lora }}{{ if .enabled }}
- name: lora-adapters
  mountPath: {{ .mountPath }}
  readOnly: true
{{- end }}{{ end }}
{{- end }}

{{/* The frontend's --lora-modules, one per declared adapter */}}
{{- define "diptych.loraModuleArgs" -}}
{{- with .Values.lora }}{{ if .enabled }}
{{- $root := .mountPath }}
{{- range .modules }}
- --lora-modules={{ required "each lora.modules entry needs a name" .name }}={{ $root }}/{{ required "each lora.modules entry needs a path" .path }}
{{- end }}
{{- end }}{{ end }}
{{- end }}

{{- define "diptych.modelMount" -}}
{{- if ne .m.source "builtin" }}
- name: model
  mountPath: /models
  readOnly: {{ ne .m.source "image" }}
{{- end }}
{{- end }}

{{/* The init container that copies an image-packaged model (or, for a frontend, its
tokenizer files: the directory's files but the weights; a .gguf whole, its tokenizer is
inside) into the pod's emptyDir. It requests the emptyDir's size in ephemeral storage, so
the scheduler picks a node with room, and sets no ephemeral-storage limit: the kubelet
counts the emptyDir against the pod's limit (the largest init container's, or the app
containers' summed), so a limit here smaller than the model evicts the pod. */}}
{{- define "diptych.modelInit" -}}
{{- $m := .m -}}
{{- if eq $m.source "image" }}
{{- $img := $m.image }}
initContainers:
  - name: model
    image: "{{ required "an image repository is required for source image (model.image, frontend.tokenizer.image)" $img.repository }}:{{ required "an image tag is required for source image (model.image, frontend.tokenizer.image)" $img.tag }}"
    imagePullPolicy: IfNotPresent
    {{- if $m.tokenizerOnly }}
    # the image needs a POSIX sh, cp and dirname (busybox has them)
    command:
      - sh
      - -c
      - |
        set -eu
        src="$1"; dst="$2"
        mkdir -p "$(dirname "$dst")"
        if [ -d "$src" ]; then
          mkdir -p "$dst"
          for f in "$src"/*; do
            case "$f" in
              *.safetensors|*.bin|*.pt|*.pth|*.h5|*.msgpack|*.onnx) ;;
              *) if [ -f "$f" ]; then cp -L "$f" "$dst/"; fi ;;
            esac
          done
        else
          cp -L "$src" "$dst"
        fi
      - copy-tokenizer
      - {{ printf "%s/%s" (trimSuffix "/" $img.path) (required "model.path is required unless model.source is builtin" $m.path) | quote }}
      - {{ printf "/models/%s" $m.path | quote }}
    {{- else }}
    command: ["cp", "-a", "{{ trimSuffix "/" $img.path }}/.", "/models/"]
    {{- end }}
    securityContext:
      {{- include "diptych.securityContext" .ctx | nindent 6 }}
    resources:
      requests: {cpu: 500m, memory: 256Mi, ephemeral-storage: {{ $m.sizeLimit }}}
      limits: {cpu: "2", memory: 1Gi}
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
{{- with include "diptych.clusterSecretName" . }}
- name: cluster-secret
  secret:
    secretName: {{ . | quote }}
    defaultMode: 0400
{{- end }}
{{- if eq (include "diptych.controlPlanePki" .) "true" }}
- name: control-plane
  secret:
    secretName: {{ include "diptych.fullname" . }}-control-plane-client
    defaultMode: 0400
{{- end }}
{{- if .Values.grpcTls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ include "diptych.fullname" . }}-control-plane-client
    defaultMode: 0400
    items:
      - {key: ca.crt, path: ca.pem}
      - {key: tls.crt, path: cert.pem}
      - {key: tls.key, path: key.pem}
{{- end }}
{{- with .Values.controlPlaneSecret }}
- name: control-plane-external
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
{{- if include "diptych.clusterSecretName" . }}
- name: cluster-secret
  mountPath: /etc/diptych/cluster-secret
  readOnly: true
{{- end }}
{{- if eq (include "diptych.controlPlanePki" .) "true" }}
- name: control-plane
  mountPath: {{ include "diptych.clientDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.grpcTls.enabled }}
- name: grpc-tls
  mountPath: /etc/diptych/grpc-tls
  readOnly: true
{{- end }}
{{- if .Values.controlPlaneSecret }}
- name: control-plane-external
  mountPath: /etc/diptych/control-plane-external
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
{{- if .Values.grpcTls.enabled }}
- name: DIPTYCH_GRPC_TLS_DIR
  value: /etc/diptych/grpc-tls
{{- end }}
{{- if include "diptych.clusterSecretName" . }}
- name: DIPTYCH_CLUSTER_SECRET_FILE
  value: /etc/diptych/cluster-secret/{{ .Values.clusterSecret.key }}
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/* A Deployment's strategy from a role's updateStrategy (Recreate takes no rollingUpdate,
which Helm's merge with the default would otherwise leave in). */}}
{{- define "diptych.strategy" -}}
{{- if eq (default "RollingUpdate" .type) "Recreate" -}}
type: Recreate
{{- else -}}
type: RollingUpdate
{{- with .rollingUpdate }}
rollingUpdate:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/* A role's extra pod-spec fields: runtimeClassName, priorityClassName,
topologySpreadConstraints (each only when set). */}}
{{- define "diptych.podExtras" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
