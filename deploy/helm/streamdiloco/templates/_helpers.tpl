{{/* Names: <release>-shard-N pods behind the headless Service <release>-shards; <release>-worker-N behind
<release>-workers. */}}
{{- define "streamdiloco.prefix" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "streamdiloco.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: (dict "top" $ "component" "shard") */}}
{{- define "streamdiloco.selector" -}}
app.kubernetes.io/name: {{ .top.Chart.Name }}
app.kubernetes.io/instance: {{ .top.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* every shard's stable DNS name (pod.service, resolvable in the release's namespace), one per line */}}
{{- define "streamdiloco.shardHosts" -}}
{{- $prefix := include "streamdiloco.prefix" . -}}
{{- range $i := until (int .Values.shards.replicas) }}
{{ printf "%s-shard-%d.%s-shards" $prefix $i $prefix }}
{{- end -}}
{{- end -}}

{{/* the names the shards' certificate must hold: short, namespaced and fully qualified */}}
{{- define "streamdiloco.shardNames" -}}
{{- $ns := .Release.Namespace -}}
{{- range $host := splitList "\n" (include "streamdiloco.shardHosts" . | trim) }}
- {{ $host }}
- {{ printf "%s.%s.svc" $host $ns }}
- {{ printf "%s.%s.svc.cluster.local" $host $ns }}
{{- end -}}
{{- range .Values.tls.extraDnsNames }}
- {{ . }}
{{- end -}}
{{- end -}}

{{/* the run's flags, the same for shards and workers: a YAML list */}}
{{- define "streamdiloco.runArgs" -}}
- --model
- {{ .Values.run.model | quote }}
- --seed
- {{ int .Values.run.seed | quote }}
- --sync-every
- {{ int .Values.run.syncEvery | quote }}
- --num-fragments
- {{ int .Values.run.numFragments | quote }}
{{- range .Values.run.extraArgs }}
- {{ . | quote }}
{{- end -}}
{{- end -}}

{{- define "streamdiloco.image" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{/* a container's security context and the /tmp that a read-only root needs */}}
{{- define "streamdiloco.containerSecurity" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{- define "streamdiloco.volumeClaim" -}}
- metadata:
    name: checkpoints
  spec:
    accessModes:
      {{- toYaml .persistence.accessModes | nindent 6 }}
    {{- with .persistence.storageClassName }}
    storageClassName: {{ . | quote }}
    {{- end }}
    resources:
      requests:
        storage: {{ .persistence.size | quote }}
{{- end -}}
